"""The supervised training loop of steps 1, 2 and DPO: micro-batches -> optimiser steps, with
logging, periodic evaluation, resumable training states and a stop on repeated NaN/Inf losses.

The programs pass what is theirs (the engine, the loader, the loss, the evaluation); the loop is the
same for all of them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader

from rlhfkit import distributed as dist
from rlhfkit.errors import RlhfkitError
from rlhfkit.faults import crash_point, nonfinite_injected
from rlhfkit.loaders import to_device


@dataclass
class LoopResult:
    steps: int = 0
    samples: int = 0  # training sequences seen, all ranks
    tokens: int = 0  # real (non-pad) training tokens, all ranks
    seconds: float = 0.0
    evals: list[dict] = field(default_factory=list)  # (step, metrics) of each evaluation
    last_train: dict = field(default_factory=dict)
    nonfinite_skipped: int = 0  # updates skipped for a NaN/Inf loss


class NonFiniteGuard:
    """Skips updates whose loss is NaN/Inf on any rank (all ranks skip together), counts them, and
    stops the run after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int, last_state: Callable[[], Any]):
        self.max_consecutive = max_consecutive
        self.last_state = last_state
        self.total = 0
        self.consecutive = 0
        self.seen = 0

    def ok(self, loss: torch.Tensor) -> bool:
        self.seen += 1
        bad = (not torch.isfinite(loss.detach()).all().item()) or nonfinite_injected(self.seen)
        if dist.all_reduce_sum(torch.tensor([float(bad)], device=loss.device)).item() == 0:
            self.consecutive = 0
            return True
        self.total += 1
        self.consecutive += 1
        dist.print_rank0(f"[nonfinite] loss is NaN/Inf: update skipped ({self.consecutive} in a row, {self.total} in all)")
        if self.consecutive >= self.max_consecutive:
            where = self.last_state()
            raise RlhfkitError(f"{self.consecutive} consecutive non-finite losses (--max_nonfinite_steps {self.max_consecutive}); "
                               f"stopped. Last good training state: {where or 'none saved (set --save_interval)'}; "
                               "lower the learning rate or check the data, then --resume")
        return False


def fit(
    engine,
    loader: DataLoader,
    *,
    compute_loss: Callable[[dict], tuple[torch.Tensor, dict]],
    evaluate: Callable[[], dict],
    total_steps: int,
    epochs: int,
    grad_accum: int,
    eval_interval: int,
    log_interval: int,
    logger,
    program: str,
    progress_bar: bool = True,
    run_state: Optional[Any] = None,
    max_nonfinite_steps: int = 10,
    sequences_per_row: int = 1,
) -> LoopResult:
    """Train ``engine`` over ``loader`` for ``total_steps`` optimiser steps (or the epochs).

    ``compute_loss(batch) -> (loss, stats)`` runs the forward pass; stats are python floats averaged
    over ranks and micro-batches for logging. ``evaluate() -> metrics`` runs before training, every
    ``eval_interval`` steps and at the end. With ``run_state`` (:class:`rlhfkit.resume.RunState`) the
    loop resumes from a saved state (same data order: the sampler is reseeded per epoch and the
    batches already trained on are skipped) and saves one every ``save_interval`` steps.
    ``sequences_per_row``: how many training sequences a batch row holds (2 for a packed pair), for
    the samples count.
    """
    from tqdm import tqdm

    res = LoopResult()
    start_epoch, skip = _resume_or_evaluate(res, run_state, evaluate, logger)
    guard = NonFiniteGuard(max_nonfinite_steps, lambda: run_state.last_saved if run_state is not None else None)
    bar = tqdm(total=total_steps, initial=res.steps, desc=program, disable=not (progress_bar and dist.is_main()),
               dynamic_ncols=True, file=sys.stdout)
    window = _Window(time.time(), res.samples, res.tokens)
    engine.train()
    for epoch in range(start_epoch, epochs):
        if res.steps >= total_steps:
            break
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if epoch == start_epoch and index < skip:
                continue
            if not _train_micro_batch(engine, batch, compute_loss, guard, res, window, sequences_per_row):
                continue
            if window.micro_batches % grad_accum:
                continue
            res.steps += 1
            bar.update(1)
            if res.steps % log_interval == 0 or res.steps == total_steps:
                res.last_train = window.means(engine, res, epoch, guard.total)
                logger.log(res.steps, {f"train/{k}": v for k, v in res.last_train.items()}, write=bar.write)
            if eval_interval and res.steps % eval_interval == 0 and res.steps < total_steps:
                _evaluate(res, evaluate, logger, write=bar.write)
                engine.train()
            if run_state is not None:
                _save_if_due_or_preempted(run_state, res, epoch, index)
            if res.steps >= total_steps:
                break
    bar.close()
    res.seconds = time.time() - window.t0
    res.nonfinite_skipped = guard.total
    if not res.evals or res.evals[-1]["step"] != res.steps:
        _evaluate(res, evaluate, logger)
    return res


def _save_if_due_or_preempted(run_state: Any, res: LoopResult, epoch: int, index: int) -> None:
    """Save a training state every --save_interval steps, and when a rank got a preemption signal (then
    stop: :class:`rlhfkit.preempt.Preempted`). Collective."""
    from rlhfkit import preempt

    counters = {"epoch": epoch, "batch_in_epoch": index + 1, "samples": res.samples, "tokens": res.tokens}
    path = run_state.save(res.steps, counters, extra={"evals": res.evals}) if run_state.due(res.steps) else None
    if preempt.stop_requested():
        path = path or run_state.save(res.steps, counters, extra={"evals": res.evals})
        raise preempt.stop(str(path), res.steps)


@dataclass
class _Window:
    """The stats summed since the last train log line, and where the throughput is measured from."""

    t0: float
    samples0: int
    tokens0: int
    sums: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 0

    def add(self, stats: dict) -> None:
        self.micro_batches += 1
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def means(self, engine, res: LoopResult, epoch: int, nonfinite_skipped: int) -> dict:
        """The window's stats averaged over ranks and micro-batches, with rates and counters; starts a new window."""
        means = dist.mean_over_ranks({k: v / self.micro_batches for k, v in self.sums.items()}, engine.device)
        elapsed = time.time() - self.t0
        means.update(lr=engine.get_lr()[0], samples_per_s=(res.samples - self.samples0) / elapsed,
                     tokens_per_s=(res.tokens - self.tokens0) / elapsed, samples=res.samples, tokens=res.tokens, epoch=epoch,
                     nonfinite_skipped=nonfinite_skipped)
        self.sums, self.micro_batches = {}, 0
        return means


def _train_micro_batch(engine, batch: dict, compute_loss: Callable, guard: NonFiniteGuard, res: LoopResult, window: _Window,
                       sequences_per_row: int) -> bool:
    """Forward, backward and engine step of one micro-batch (DeepSpeed steps the optimiser at the
    accumulation boundary); False when the loss was skipped as non-finite."""
    batch = to_device(batch, engine.device)
    loss, stats = compute_loss(batch)
    if not guard.ok(loss):
        return False
    engine.backward(loss)
    crash_point("train_step")
    engine.step()
    window.add(stats)
    res.samples += int(batch["input_ids"].shape[0]) * sequences_per_row * dist.world_size()
    if "attention_mask" in batch:
        res.tokens += int(dist.all_reduce_sum(batch["attention_mask"].sum().to(torch.float64)).item())
    return True


def _resume_or_evaluate(res: LoopResult, run_state: Optional[Any], evaluate: Callable[[], dict], logger) -> tuple[int, int]:
    """Restore the counters of a saved training state into ``res`` -> (epoch, batch in epoch) to go on
    from; without one, evaluate the starting model -> (0, 0)."""
    restored = run_state.restore() if run_state is not None else None
    if not restored:
        _evaluate(res, evaluate, logger)
        return 0, 0
    c = restored["counters"]
    res.steps, res.samples, res.tokens = c["step"], c["samples"], c["tokens"]
    res.evals = restored["extra"].get("evals", [])
    return c["epoch"], c["batch_in_epoch"]


def _evaluate(res: LoopResult, evaluate: Callable[[], dict], logger, write: Optional[Callable] = None) -> None:
    ev = evaluate()
    res.evals.append({"step": res.steps, **ev})
    logger.log(res.steps, {f"eval/{k}": v for k, v in ev.items()}, write=write)
