"""Step 3's four models: the actor (trained) and its frozen copy, the reference; the critic (trained,
from the step-2 reward model) and the frozen reward model. The GRPO family has no critic.

Each is a DeepSpeed engine. The experience passes need no gradient: ZeRO-3 models run them on a
gathered, hook-free copy (:class:`GatheredCopy`: one all-gather per model per step instead of
DeepSpeed's per-layer fetch hooks); the frozen models' copies are gathered once and kept with
``--keep_inference_copy``. A model whose parameters are offloaded keeps the engine path: a full copy
on the device is what the offload avoids. The actor's copy is the rollout engine's own: it
generates, then scores what it generated (one gather of the actor a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from rlhfkit.ds_config import init_config
from rlhfkit.models import apply_lora, enable_gradient_checkpointing, load_model
from rlhfkit.models.gathered import GatheredCopy
from rlhfkit.rollout import RolloutEngine, make_rollout_engine, training_engine_options
from rlhfkit.engines import batch_plan, build_engine, build_frozen_engine
from rlhfkit.params import param_fingerprint

T = TypeVar("T")


def attention_kernel(cfg: Any) -> Optional[str]:
    """``--attn_implementation`` for transformers (None: the model's default)."""
    return None if cfg.attn_implementation == "auto" else cfg.attn_implementation


def load_trained(path: str, kind: str, role: str, cfg: Any, *, total_updates: int, pad_id: int,
                 hybrid_engine: Optional[dict] = None):
    """The actor or the critic (``role``, whose ``--<role>_*`` flags apply) as a DeepSpeed training engine."""
    zero_stage = getattr(cfg, f"{role}_zero_stage")
    model = load_model(path, kind, dtype=cfg.dtype, dropout=getattr(cfg, f"{role}_dropout"), pad_token_id=pad_id,
                       attn_implementation=attention_kernel(cfg),
                       zero3_ds_config=init_config(zero_stage=zero_stage, dtype=cfg.dtype, offload=cfg.offload),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights)
    if getattr(cfg, f"{role}_gradient_checkpointing"):
        enable_gradient_checkpointing(model)
    model = apply_lora(model, getattr(cfg, f"{role}_lora_dim"), None, getattr(cfg, f"{role}_lora_module_name"), cfg.only_optimize_lora,
                       task_type="CAUSAL_LM" if kind == "causal_lm" else "SEQ_CLS")
    return build_engine(model, plan=batch_plan(cfg.per_device_training_batch_size, 1), zero_stage=zero_stage, dtype=cfg.dtype,
                        offload=cfg.offload, learning_rate=getattr(cfg, f"{role}_learning_rate"),
                        weight_decay=getattr(cfg, f"{role}_weight_decay"), betas=(cfg.adam_beta1, cfg.adam_beta2),
                        gradient_clipping=cfg.gradient_clipping, lr_scheduler_type=cfg.lr_scheduler_type,
                        num_warmup_steps=cfg.num_warmup_steps, total_steps=total_updates, hybrid_engine=hybrid_engine,
                        block_leaves=cfg.zero3_block_leaves, compile_blocks=cfg.compile_blocks)


def load_frozen(path: str, kind: str, cfg: Any, *, zero_stage: int, offload: bool, pad_id: int):
    """The reference or the reward model as a DeepSpeed inference engine, ZeRO-3 sharded if asked."""
    model = load_model(path, kind, dtype=cfg.dtype, dropout=0.0, pad_token_id=pad_id, attn_implementation=attention_kernel(cfg),
                       zero3_ds_config=init_config(zero_stage=zero_stage, dtype=cfg.dtype),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights)
    return build_frozen_engine(model, zero_stage=zero_stage, dtype=cfg.dtype, offload=offload,
                               micro_batch=cfg.per_device_training_batch_size, block_leaves=cfg.zero3_block_leaves)


@dataclass
class PPOModels:
    actor: Any  # DeepSpeed training engine of the policy
    ref: Any  # frozen reference (the actor's starting weights)
    critic: Optional[Any]  # DeepSpeed training engine of the value model (None: critic-free algorithm)
    reward: Optional[Any]  # frozen reward model (None: rule rewards only)
    rollout: RolloutEngine  # generates with the actor
    views: dict[str, GatheredCopy] = field(default_factory=dict)  # name -> gathered copy for the no-grad passes
    judges: dict[str, Any] = field(default_factory=dict)  # name -> frozen reward model of the held-out evaluation (--judge)

    def no_grad_forward(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(model, *args)`` with ``model`` the gathered copy of ``name`` (actor, ref, critic, reward),
        or its engine where it has none."""
        view = self.views.get(name)
        if view is not None:
            return view.run(fn, *args)
        return fn(self.judges[name] if name in self.judges else getattr(self, name), *args)

    def trained(self) -> dict[str, Any]:
        """The engines a training state saves."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def frozen_fingerprints(self) -> dict[str, float]:
        """Checksums of the frozen models' weights (collective): they must not move during training."""
        frozen = {"reference": self.ref, **({"reward_model": self.reward} if self.reward is not None else {}), **self.judges}
        return {k: param_fingerprint(m.module) for k, m in frozen.items()}


def judge_names(paths: list[str]) -> list[str]:
    """The metric names of the ``--judge`` models: ``judge`` for one, ``judge1``, ``judge2``, ... for several."""
    return ["judge"] if len(paths) == 1 else [f"judge{i}" for i in range(1, len(paths) + 1)]


def build_models(cfg: Any, *, actor_path: str, critic_path: Optional[str], reward_path: Optional[str], pad_id: int,
                 total_updates: int) -> PPOModels:
    """Load the four models of step 3 (three for critic-free algorithms) and the rollout engine."""
    he = training_engine_options(cfg.backend, cfg.rollout_options)
    actor = load_trained(actor_path, "causal_lm", "actor", cfg, total_updates=total_updates, pad_id=pad_id, hybrid_engine=he)
    ref = load_frozen(actor_path, "causal_lm", cfg, zero_stage=cfg.actor_zero_stage, offload=cfg.offload_reference_model,
                      pad_id=pad_id)
    critic = (load_trained(critic_path, "reward", "critic", cfg, total_updates=total_updates, pad_id=pad_id)
              if critic_path else None)
    reward = (load_frozen(reward_path, "reward", cfg, zero_stage=cfg.critic_zero_stage, offload=cfg.offload_reward_model,
                          pad_id=pad_id) if reward_path else None)
    judges = {name: load_frozen(path, "reward", cfg, zero_stage=cfg.critic_zero_stage, offload=cfg.offload_reward_model,
                                pad_id=pad_id) for name, path in zip(judge_names(cfg.judge), cfg.judge)}
    rollout = make_rollout_engine(cfg.backend, actor, cfg.rollout_options)
    models = PPOModels(actor=actor, ref=ref, critic=critic, reward=reward, rollout=rollout, judges=judges)
    if cfg.experience_on_copies:
        for name, frozen, offloaded in (("actor", False, cfg.offload), ("ref", True, cfg.offload_reference_model),
                                        ("critic", False, cfg.offload), ("reward", True, cfg.offload_reward_model),
                                        *((name, True, cfg.offload_reward_model) for name in judges)):
            engine = judges[name] if name in judges else getattr(models, name)
            if engine is None or offloaded:
                continue
            own = rollout.inference_copy if name == "actor" else None
            models.views[name] = own if own is not None else GatheredCopy(engine, keep=cfg.keep_inference_copy, frozen=frozen)
    return models
