"""Where a step-3 run stands, beside its engines and RNGs: what a training state records so that a
resumed run continues exactly (the step, the counters, the position in the prompts and PTX data, the
KL coefficient, the running reward moments (the total's and each reward function's), the evaluations so far, each rank's EMA shard)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhfkit import distributed as dist
from rlhfkit.algos import AdaptiveKLController, FixedKLController, masked_sum
from rlhfkit.experience import Experience
from rlhfkit.loaders import BatchStream


@dataclass
class Progress:
    prompts: BatchStream  # the training prompts, endless, with their position
    ptx: Optional[BatchStream] = None  # the PTX (pretraining) batches, or None
    step: int = 0  # PPO steps done
    samples: int = 0  # samples trained on, all ranks
    tokens: float = 0.0  # response tokens trained on, all ranks
    evals: list[dict] = field(default_factory=list)  # {"step": N, metric: value} of each held-out evaluation

    def restore(self, restored: dict, kl_ctl: Any, ema: Optional[Any], reward_norm: Optional[Any] = None,
                reward_fns: Optional[Any] = None) -> None:
        """Continue from a training state (``RunState.restore()``'s result)."""
        c, extra = restored["counters"], restored["extra"]
        self.step, self.samples, self.tokens = c["step"], c["samples"], c["tokens"]
        self.prompts = BatchStream(self.prompts.loader, **c["prompts"])
        if self.ptx is not None:
            self.ptx = BatchStream(self.ptx.loader, **c["ptx"])
        kl_ctl.load_state_dict(extra["kl_ctl"])
        self.evals = extra["evals"]
        if reward_norm is not None:
            reward_norm.load_state_dict(extra["reward_norm"])
        if reward_fns is not None and extra.get("reward_fn_norms"):
            reward_fns.load_state_dict(extra["reward_fn_norms"])
        if ema is not None:
            ema.load_state_dict(restored["rank_extra"]["ema"])

    def save(self, run_state: Any, kl_ctl: Any, ema: Optional[Any], reward_norm: Optional[Any] = None,
             reward_fns: Optional[Any] = None) -> Any:
        """Write a training state at the current step; returns its path."""
        counters = {"samples": self.samples, "tokens": self.tokens, "prompts": self.prompts.position(),
                    **({"ptx": self.ptx.position()} if self.ptx is not None else {})}
        extra = {"kl_ctl": kl_ctl.state_dict(), "evals": self.evals,
                 **({"reward_norm": reward_norm.state_dict()} if reward_norm is not None else {}),
                 **({"reward_fn_norms": reward_fns.state_dict()} if reward_fns else {})}
        return run_state.save(self.step, counters, extra=extra,
                              rank_extra={"ema": ema.state_dict()} if ema is not None else None)

    def checkpoint(self, run_state: Any, *parts: Any) -> None:
        """Save a training state every --save_interval steps, and when a rank got a preemption signal (then
        stop: :class:`rlhfkit.preempt.Preempted`). ``parts``: :meth:`save`'s. Collective."""
        from rlhfkit import preempt

        path = self.save(run_state, *parts) if run_state.due(self.step) else None
        if preempt.stop_requested():
            raise preempt.stop(str(path or self.save(run_state, *parts)), self.step)


def update_kl_controller(kl_ctl: Any, exp: Experience) -> None:
    """Feed the adaptive KL controller (PPO-penalty) the batch's mean KL per sequence over all ranks."""
    seq_kl = masked_sum(exp.kl, exp.action_mask, dim=-1)
    kl_ctl.update(dist.all_reduce_mean(seq_kl.mean().detach()).item(), len(exp) * dist.world_size())


def kl_controller(cfg: Any) -> Any:
    """A fixed KL coefficient, or the adaptive one with ``--target_kl``."""
    return AdaptiveKLController(cfg.kl_ctl, cfg.target_kl, cfg.kl_horizon) if cfg.target_kl else FixedKLController(cfg.kl_ctl)
