"""Step 3 resumed on another number of ranks (``--resume_allow_world_size_change``).

A state saved by N ranks resumes on M ranks. What is kept, and how:
- the prompts per step over all ranks (``--per_device_generation_batch_size`` x ``--generation_batches``
  x ranks): the per-rank generation batch becomes ``generation x N / M``, ``--generation_batches`` stays.
  The length-grouped prompt order is built from global batches of ``generation x ranks`` prompts, the
  same number on M ranks as on N, so each step draws the same prompts, and the saved position (epoch,
  batch index) means the same place in the epoch: the resumed run trains on exactly the prompts the
  uninterrupted run had not yet reached. A prompt's ``--n_samples_per_prompt`` samples are generated on
  the rank that holds the prompt, so a group never spans ranks;
- the samples per update over all ranks (``--per_device_training_batch_size`` x ranks): the per-rank
  training batch becomes ``training x N / M``, so the updates per step, and with them the learning-rate
  schedule, stay. Where a group of G samples divided the saved per-rank training batch (whole groups in
  each mini-batch, the condition of packed groups), G must divide the new one;
- the actor's and the critic's weights, optimizer moments and schedules: DeepSpeed's universal checkpoint
  (:func:`rlhfkit.resume_reshard.load_resharded`, as steps 1 and 2 do). The frozen models (reference,
  reward model, judges) are rebuilt from their checkpoints and need nothing;
- the actor's EMA, kept per rank on what the rank owns (:class:`rlhfkit.params.ParamEMA`): under ZeRO-3
  every saved rank's partition of a parameter is read, joined and cut again into this run's partitions;
  under ZeRO 0-2 every rank held the whole average, and new rank ``r`` takes saved rank ``r % N``'s;
- the KL controller, the running reward moments (the total's and each reward function's) and the
  evaluations: the same on every rank (all-reduced), in ``state.json``, restored as they are;
- the RNG streams: new rank ``r`` takes those of saved rank ``r % N`` (:meth:`rlhfkit.resume.RunState.restore`);
- the PTX stream continues at its batch index; its global batches keep their size (the per-rank PTX
  batch is the training batch), and their rows are the same except at an epoch's tail, which the
  distributed sampler pads to a multiple of the rank count.

Where the saved sizes do not divide by M (or the groups would be split), the resume is refused with the
rank counts that would work and their per-rank batches. Not kept: bit-identity with an uninterrupted run
(other samples are drawn, and reductions sum in another order).

A state records the per-rank batches it ran with (``layout``), so that a run resumed on M ranks, saved and
resumed again on M ranks with the same flags, keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.errors import CheckpointError
from rlhfkit.params import local_tensor
from rlhfkit.resume_reshard import load_resharded, picked_state

BATCH_FIELDS = ("per_device_generation_batch_size", "per_device_training_batch_size")
KEPT = ("the prompts per step and the samples per update over all ranks are kept by changing "
        "--per_device_generation_batch_size and --per_device_training_batch_size")


@dataclass(frozen=True)
class PPOLayout:
    """Step 3's per-rank batches, and the state ``--resume`` picked (None: a fresh start)."""

    generation_batch: int  # prompts per rank per generation batch
    training_batch: int  # samples per rank per mini-batch (one optimiser step)
    world_size: int
    state: Optional[str] = None
    saved_world_size: Optional[int] = None  # set where the state was saved by another number of ranks

    def to_json(self) -> dict:
        return {"generation_batch": self.generation_batch, "training_batch": self.training_batch}

    def apply(self, cfg: Any) -> None:
        """Set the per-rank batch flags of ``cfg`` to this layout's."""
        cfg.per_device_generation_batch_size, cfg.per_device_training_batch_size = self.generation_batch, self.training_batch

    def attach(self, run_state: Any, flags: dict) -> Any:
        """``run_state`` (a :class:`rlhfkit.resume.RunState`) told this layout: it restores the picked state,
        re-partitioned where the world size changed, and saves the layout. ``flags``: the config as given,
        before :meth:`apply` (what a later resume compares with the flags it is given)."""
        run_state.layout, run_state.config = self, flags
        return run_state

    def load_resharded(self, engines: dict[str, Any], path: Path, counters: dict) -> dict:
        """Load a state of another world size into ``engines``; the counters stay as saved (the prompt
        position counts global batches, whose size is kept). Called by ``RunState.restore``."""
        load_resharded(engines, path)
        return counters

    def resharded(self, restored: dict, ema: Optional[Any]) -> dict:
        """``restored`` (``RunState.restore()``'s result) with this rank's EMA cut from every saved rank's
        where the world size changed (:func:`resharded_ema`)."""
        if self.saved_world_size is None or ema is None or "ema" not in restored["rank_extra"]:
            return restored
        rank_extra = {**restored["rank_extra"], "ema": resharded_ema(Path(self.state), self.saved_world_size, ema)}
        return {**restored, "rank_extra": rank_extra}


def saved_layout(saved: dict) -> PPOLayout:
    """The per-rank batches a saved state ran with (older states: its config's)."""
    lay = saved.get("layout") or {"generation_batch": saved["config"]["per_device_generation_batch_size"],
                                  "training_batch": saved["config"]["per_device_training_batch_size"]}
    return PPOLayout(lay["generation_batch"], lay["training_batch"], saved["world_size"])


def reshard_batches(old: PPOLayout, world: int, group: int, path: Any) -> PPOLayout:
    """The per-rank batches that keep ``old``'s prompts per generation batch and samples per update on
    ``world`` ranks (``group``: ``--n_samples_per_prompt``). Raises a CheckpointError naming the rank
    counts, with their per-rank batches, that would keep them when ``world`` cannot."""
    prompts, samples = old.generation_batch * old.world_size, old.training_batch * old.world_size
    whole_groups = old.training_batch % group == 0

    def problem(m: int) -> Optional[str]:
        if prompts % m:
            return f"{prompts} prompts per generation batch do not divide by {m} ranks"
        if samples % m:
            return f"{samples} samples per update do not divide by {m} ranks"
        if whole_groups and (samples // m) % group:
            return (f"{samples // m} samples per rank per update would split the groups of {group} samples "
                    f"(--n_samples_per_prompt), which the saved run's mini-batches kept whole")
        return None

    why = problem(world)
    if why:
        works = [f"{m} (--per_device_generation_batch_size {prompts // m} --per_device_training_batch_size {samples // m})"
                 for m in range(1, prompts + 1) if problem(m) is None]
        raise CheckpointError(f"--resume {path}: the saved run took {prompts} prompts per generation batch and {samples} "
                              f"samples per update over its {old.world_size} ranks ({old.generation_batch} and "
                              f"{old.training_batch} per rank), and on {world} ranks {why}; resume on a number of ranks "
                              f"that keeps both: {', '.join(works)}.")
    return PPOLayout(prompts // world, samples // world, world)


def resume_layout(cfg: Any) -> PPOLayout:
    """Step 3's per-rank batches: the flags for a fresh start, the saved run's when ``--resume`` picks a
    state (re-cut for another number of ranks where allowed). Collective; call before the prompt loader
    and the engines are built, then :meth:`PPOLayout.apply` it to ``cfg``."""
    world = dist.world_size()
    fresh = PPOLayout(cfg.per_device_generation_batch_size, cfg.per_device_training_batch_size, world)
    path, saved, old, layout = picked_state(cfg, fresh, saved_layout, BATCH_FIELDS, kept=KEPT, order="prompt")
    if layout is not None:
        return layout
    new = reshard_batches(old, world, cfg.n_samples_per_prompt, path)
    at = saved["counters"]["prompts"]
    dist.print_rank0(f"[resume] {old.world_size} -> {world} ranks: {new.generation_batch * world} prompts per generation "
                     f"batch and {new.training_batch * world} samples per update are kept as --per_device_generation_batch_size "
                     f"{new.generation_batch} --per_device_training_batch_size {new.training_batch} (saved: "
                     f"{old.generation_batch} and {old.training_batch} per rank); continuing at prompt batch {at['index']} "
                     f"of epoch {at['epoch']}; rank r takes the RNG streams of saved rank r % {old.world_size}")
    return replace(new, state=path, saved_world_size=old.world_size)


def recut(shards: list[torch.Tensor], numel: int, size: int, rank: int) -> torch.Tensor:
    """One ZeRO-3 parameter's slice for ``rank`` in partitions of ``size`` elements, from the saved ranks'
    partitions (in rank order, each a flat slice of the parameter padded to a multiple of the saved rank
    count) of a parameter of ``numel`` elements. The padding past ``numel`` is zeros."""
    whole = torch.cat([s.reshape(-1) for s in shards])[:numel]
    part = whole[rank * size:(rank + 1) * size]
    return torch.cat([part, part.new_zeros(size - part.numel())])


def resharded_ema(path: Path, saved_world: int, ema: Any) -> dict:
    """This rank's :class:`rlhfkit.params.ParamEMA` state from the EMA shards of a state saved by
    ``saved_world`` ranks. ZeRO-3: every saved rank's shards are read (the whole average, once, in host
    memory) and cut into this rank's partitions; ZeRO 0-2: saved rank ``r % N``'s whole average."""
    partitioned = any(hasattr(p, "ds_tensor") for p in ema.params)
    ranks = range(saved_world) if partitioned else [dist.rank() % saved_world]
    saved = [torch.load(path / f"extra_rank{k}.pt", weights_only=True)["ema"]["shadow"] for k in ranks]
    if any(len(s) != len(ema.params) for s in saved):
        raise CheckpointError(f"--resume {path}: the saved EMA has {len(saved[0])} tensors and the actor "
                              f"{len(ema.params)} trained parameters")
    if not partitioned:
        return {"beta": ema.beta, "shadow": saved[0]}
    shadow = [recut([s[i] for s in saved], p.ds_numel, local_tensor(p).numel(), dist.rank())
              for i, p in enumerate(ema.params)]
    return {"beta": ema.beta, "shadow": shadow}
