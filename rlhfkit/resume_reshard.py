"""Resuming a training state on another number of ranks (``--resume_allow_world_size_change``).

Steps 1, 2 and DPO (the supervised loop) here. Step 3 re-cuts its per-rank batches and EMA shards in
:mod:`rlhfkit.ppo.reshard` and loads its actor and critic engines with :func:`load_resharded`.

What is kept, and how:
- the global batch (rows per optimiser step): the per-rank micro-batch and the gradient
  accumulation are recomputed (:func:`reshard_layout`); the micro-batch never grows past
  ``--per_device_train_batch_size``, so a rank needs no more memory than it was told it may use;
- the data order: the length-grouped sampler builds each epoch's order from global batches of the
  *first* run's size (``order_batch``, carried from state to state), whatever the number of ranks,
  and a run cuts that order into its own global micro-batches, which must divide it. The position
  in the epoch is a count of rows, so the resumed run trains on exactly the rows the uninterrupted
  run had not yet reached;
- the weights, optimizer moments and schedule: a ZeRO-1/2/3 engine checkpoint is converted on rank 0
  by DeepSpeed's universal checkpoint converter (``ds_to_universal``) into ``.universal_step_<N>``
  next to the state (the state itself stays as it was, its hashes valid), loaded by every rank with
  DeepSpeed's universal loader, then deleted; a ZeRO-0 checkpoint holds whole tensors and loads as is;
- the RNG streams: new rank ``r`` takes those of saved rank ``r % N`` (N: the saved world size).

Not kept: bit-identity with an uninterrupted run (reduction order and the split of the global batch
into micro-batches change the float sums).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from rlhfkit import distributed as dist
from rlhfkit.errors import CheckpointError, ConfigError
from rlhfkit.resume import KEPT_BATCH, STATE_FILE, pick_state, world_size_refusal

BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Layout:
    """How a supervised run cuts its global batch, and the state it resumes from.

    ``order_batch``: the global batch size the sampler builds the data order from (the first run's
    ``micro_batch x world_size``). ``state``: the training state chosen by ``--resume`` (None: a fresh
    start). ``saved_micro_rows``: the saved run's rows per global micro-batch (its position unit)."""

    micro_batch: int
    grad_accum: int
    world_size: int
    order_batch: int
    state: Optional[str] = None
    saved_world_size: Optional[int] = None
    saved_micro_rows: Optional[int] = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum

    def to_json(self) -> dict:
        return {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "order_batch": self.order_batch}

    def load_resharded(self, engines: dict[str, Any], path: Path, counters: dict) -> dict:
        """Load a state of another world size into ``engines`` (:func:`load_resharded`) -> its counters in this
        run's micro-batches (what :class:`rlhfkit.resume.RunState` calls, without importing this module)."""
        load_resharded(engines, path)
        return resharded_counters(counters, self)


def saved_layout(saved: dict) -> Layout:
    """The layout a saved state was trained with (older states: derived from their config)."""
    n = saved["world_size"]
    if "layout" in saved:
        lay = saved["layout"]
        return Layout(lay["micro_batch"], lay["grad_accum"], n, lay["order_batch"])
    m, a = saved["config"]["per_device_train_batch_size"], saved["config"]["gradient_accumulation_steps"]
    return Layout(m, a, n, m * n)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def reshard_layout(old: Layout, world: int, max_micro: int, rows_done: int, path: Any) -> Layout:
    """The layout that keeps ``old``'s global batch and data order on ``world`` ranks, with the largest
    per-rank micro-batch up to ``max_micro``; ``rows_done``: the saved position in its epoch, in rows.
    Raises a CheckpointError naming the rank counts that would work when there is none."""
    b = old.global_batch
    # a global micro-batch must divide the order's batches, and the position must fall on one of its edges
    unit = math.gcd(old.order_batch, rows_done)
    saved = f"{old.micro_batch} per rank x {old.world_size} ranks x {old.grad_accum} accumulation"
    if b % world:
        raise CheckpointError(f"--resume {path}: the saved run's global batch of {b} rows ({saved}) does not divide by "
                              f"{world} ranks, so it cannot be kept; resume on a number of ranks that divides {unit} "
                              f"({_divisors(unit)}).")
    if unit % world:
        raise CheckpointError(f"--resume {path}: the saved run's data order is built from global batches of "
                              f"{old.order_batch} rows and it stopped {rows_done} rows into its epoch, which {world} "
                              f"ranks cannot share evenly from there on; resume on a number of ranks that divides "
                              f"{unit} ({_divisors(unit)}).")
    micro = max(m for m in range(1, max(1, max_micro) + 1) if unit % (m * world) == 0)
    return Layout(micro, b // (micro * world), world, old.order_batch)


def picked_state(cfg: Any, fresh: Any, read_layout: Callable[[dict], Any], batch_fields: tuple[str, ...], *,
                 kept: str = KEPT_BATCH, order: str = "data") -> tuple[Optional[str], Optional[dict], Any, Any]:
    """The state ``--resume`` picks, for a program whose batch layout ``fresh`` (a fresh start's) may change with
    the number of ranks: (path, saved state, saved layout, layout). ``layout`` is final where nothing is
    re-cut (no state: ``fresh``; the same number of ranks: the saved layout, or ``fresh`` where the
    ``batch_fields`` flags changed), else None; a change of rank count that is not allowed is refused."""
    path = pick_state(cfg.resume, cfg.output_dir)
    if path is None:
        return None, None, None, fresh
    saved = json.loads((Path(path) / STATE_FILE).read_text())
    old = read_layout(saved)
    if old.world_size == fresh.world_size:
        same = all(saved["config"].get(k) == getattr(cfg, k) for k in batch_fields)
        return path, saved, old, replace(old if same else fresh, state=path)
    if not cfg.resume_allow_world_size_change:
        raise CheckpointError(world_size_refusal(path, old.world_size, fresh.world_size, supported=True, kept=kept))
    if not cfg.group_by_length:
        raise ConfigError(f"--resume {path}: --resume_allow_world_size_change needs --group_by_length true (its {order} "
                          f"order is the same on any number of ranks); resume this run on {old.world_size} ranks.")
    return path, saved, old, None


def resume_layout(cfg: Any) -> Layout:
    """The batch layout of a supervised program: from its config for a fresh start, from the state
    ``--resume`` picks otherwise (re-cut for another number of ranks where allowed). Collective; call
    before the loader and the engine are built."""
    m, a, world = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, dist.world_size()
    path, saved, old, layout = picked_state(cfg, Layout(m, a, world, m * world), saved_layout, BATCH_FIELDS)
    if layout is not None:
        return layout
    c = saved["counters"]
    rows_done = c["batch_in_epoch"] * old.micro_batch * old.world_size
    new = reshard_layout(old, world, m, rows_done, path)
    dist.print_rank0(f"[resume] {old.world_size} -> {world} ranks: the global batch of {new.global_batch} rows is kept as "
                     f"{new.micro_batch} per rank x {world} ranks x {new.grad_accum} accumulation (saved: "
                     f"{old.micro_batch} x {old.world_size} x {old.grad_accum}); continuing {rows_done} rows into epoch "
                     f"{c['epoch']}; rank r takes the RNG streams of saved rank r % {old.world_size}")
    return replace(new, state=path, saved_world_size=old.world_size, saved_micro_rows=old.micro_batch * old.world_size)


def resharded_counters(counters: dict, layout: Layout) -> dict:
    """The saved counters with the position in the epoch counted in this run's micro-batches."""
    rows = counters["batch_in_epoch"] * layout.saved_micro_rows
    return {**counters, "batch_in_epoch": rows // (layout.micro_batch * layout.world_size)}


def _to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` on one engine checkpoint folder, in this process, quietly."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(src), output_folder=str(dst), num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
    except Exception as e:  # noqa: BLE001 - report which state could not be converted, with DeepSpeed's words
        raise CheckpointError(f"--resume: converting {src} for another number of ranks failed "
                              f"({type(e).__name__}: {e}); resume on the saved number of ranks") from None


def _unshare_steps(engine: Any) -> None:
    """Give each optimizer state its own ``step`` tensor. DeepSpeed's ZeRO-3 universal loader puts one
    tensor object into the state of every sub-group, and torch's AdamW increments a state's step in
    place, so with two parameter groups (decay, no decay) the step would advance twice per update and
    the bias correction of the later group would be wrong."""
    import torch

    inner = getattr(engine.optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _check_space(path: Path, names: list[str]) -> None:
    """The converted copy takes about as much disk as the engine states it converts."""
    need = sum(f.stat().st_size for name in names for f in (path / name).rglob("*") if f.is_file())
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise CheckpointError(f"--resume {path}: re-partitioning the state for another number of ranks needs about "
                              f"{need / 2**30:.2f} GiB of disk next to it, and {free / 2**30:.2f} GiB are free")


def load_resharded(engines: dict[str, Any], path: Path) -> None:
    """Load every engine's checkpoint of the state at ``path`` into engines of another world size.
    Collective."""
    conv = path.parent / f".universal_{path.name}"
    if dist.is_main():
        shutil.rmtree(conv, ignore_errors=True)
        # ZeRO 1-3: partitioned, convert; ZeRO-0: whole tensors, load as is
        partitioned = [name for name in engines if any((path / name / "ds").glob("*optim_states.pt"))]
        _check_space(path, partitioned)
        for name in partitioned:
            _to_universal(path / name / "ds", conv / name / "ds")
    dist.barrier()
    for name, engine in engines.items():
        universal = (conv / name / "ds").is_dir()
        engine._config.load_universal_checkpoint = universal  # read by load_checkpoint only
        try:
            load_path, _ = engine.load_checkpoint(str((conv if universal else path) / name), tag="ds",
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            engine._config.load_universal_checkpoint = False
        if load_path is None:
            raise CheckpointError(f"--resume {path}: DeepSpeed could not load the {name} engine state")
        if universal:
            _unshare_steps(engine)
    dist.barrier()
    if dist.is_main():
        shutil.rmtree(conv, ignore_errors=True)


def with_layout(run_state: Any, layout: Layout) -> Any:
    """``run_state`` (a :class:`rlhfkit.resume.RunState`) told the layout :func:`resume_layout` chose: it
    resumes the state that picked, re-partitioned where the world size changed, and saves the layout."""
    run_state.layout = layout
    return run_state
