"""Training states for ``--resume``: everything needed to continue a run exactly.

``<output_dir>/training_state/step_<N>/`` (N = optimiser steps done, or PPO steps in step 3) holds:
- ``<name>/``: a DeepSpeed engine checkpoint per trained model (weights, optimizer, scheduler);
- ``rng_rank<R>.pt``: python, numpy and torch RNG states of each rank (tensors and lists only, read
  back with ``torch.load(weights_only=True)``);
- ``extra_rank<R>.pt``: per-rank extras (e.g. EMA shards), same format;
- ``state.json``: counters (step, epoch, position in the epoch), program extras (KL coefficient,
  evaluations so far), the config, the world size, and a sha256 of every file, written last.

A state is written under ``.step_<N>.tmp`` and renamed when complete; ``--resume auto`` takes the
newest state whose files match their hashes (skipping, with a message, any that do not), while a
state named explicitly must be complete. A resume whose config differs in a field that changes the
run (batch sizes, data, model, ...) is refused unless ``--resume_allow_config_change``; one that the saved
engine states cannot follow (the ZeRO stage across 0, 1-2 and 3, the dtype, the LoRA adapters) always is.

A resume on another number of ranks is refused unless ``--resume_allow_world_size_change`` (which
``--resume_allow_config_change`` does not imply). With it, every program re-partitions the engines' ZeRO
state through DeepSpeed's universal checkpoint, keeps the global batch and the data position, and maps
the RNG streams deterministically: new rank ``r`` takes the saved streams of rank ``r % N`` (N: the saved
world size). The details are in :mod:`rlhfkit.resume_reshard` (steps 1, 2 and DPO) and
:mod:`rlhfkit.ppo.reshard` (step 3: its per-rank batches and EMA shards). A state records the batch
layout it was trained with (``layout``), so that a run resumed on another number of ranks, saved and
resumed again, keeps it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rlhfkit import distributed as dist
from rlhfkit.checkpoint import check_free_space, estimate_bytes, sha256_file
from rlhfkit.errors import CheckpointError

STATE_DIR = "training_state"
STATE_FILE = "state.json"
# Fields that may differ between the interrupted run and its resumption.
FREE_FIELDS = {
    "resume", "resume_allow_config_change", "resume_allow_world_size_change", "max_steps", "num_train_epochs", "eval_interval", "log_interval", "save_interval",
    "keep_last_k", "progress_bar", "enable_tensorboard", "tensorboard_path", "local_rank", "dist_timeout_s",
    "max_nonfinite_steps", "print_answers", "print_answers_interval", "output_dir", "max_eval_samples",
    "eval_n_samples_per_prompt", "eval_greedy",
}


# Fields whose change leaves DeepSpeed unable to load the saved engine states (each seen failing with a
# traceback): the ZeRO family (0, 1-2 and 3 write different files; 1 <-> 2 loads), the dtype (its optimizer
# files and groups differ) and the LoRA adapters (other parameters). Offloading may change.
ZERO_FAMILY = {0: "ZeRO-0", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}
LAYOUT_FIELDS = {f"{who}{name}" for who in ("", "actor_", "critic_") for name in ("dtype", "lora_dim", "lora_module_name")}


def layout_changes(old: dict, new: dict) -> list[str]:
    """The changed fields of ``new`` against the saved ``old`` config that the saved engine states cannot follow."""
    changed = [k for k in sorted(LAYOUT_FIELDS)
               if k in old and k in new and old[k] != new[k] and not _no_adapters(k, old, new)]
    zero = [k for k in ("zero_stage", "actor_zero_stage", "critic_zero_stage") if k in old and k in new and
            ZERO_FAMILY.get(old[k], old[k]) != ZERO_FAMILY.get(new[k], new[k])]
    return sorted(changed + zero)


def _no_adapters(field: str, old: dict, new: dict) -> bool:
    """``field`` names LoRA modules, and neither config has adapters (then the modules change nothing)."""
    dim = field.replace("module_name", "dim")
    return field.endswith("lora_module_name") and not (old.get(dim) or new.get(dim))


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
             "numpy_gauss": [int(np_state[3]), float(np_state[4])], "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], *state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _files_with_hashes(directory: Path) -> dict:
    return {f.relative_to(directory).as_posix(): {"sha256": sha256_file(f), "bytes": f.stat().st_size}
            for f in sorted(directory.rglob("*")) if f.is_file() and f.name != STATE_FILE}


def _fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` and the directories themselves."""
    for path in sorted(directory.rglob("*")) + [directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def verify_state(path: Path) -> Optional[str]:
    """None if the state at ``path`` is complete and intact, else what is wrong."""
    meta = path / STATE_FILE
    if not meta.exists():
        return f"{STATE_FILE} is missing (the save was interrupted)"
    try:
        state = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        return f"{STATE_FILE} is unreadable ({e})"
    for rel, info in state.get("files", {}).items():
        f = path / rel
        if not f.exists():
            return f"{rel} is missing"
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            return f"{rel} does not match its hash (truncated or corrupted)"
    return None


def _step_of(p: Path) -> int:
    try:
        return int(p.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def find_states(output_dir: str) -> list[Path]:
    root = Path(output_dir) / STATE_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and _step_of(p) >= 0), key=_step_of)


def _pick_local(resume: Optional[str], output_dir: str) -> Optional[Path]:
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"--resume {resume}: no such training state directory")
        problem = verify_state(path)
        if problem:
            raise CheckpointError(f"--resume {resume}: the training state is incomplete or corrupted: {problem}")
        return path
    for path in reversed(find_states(output_dir)):
        problem = verify_state(path)
        if problem is None:
            return path
        dist.print_rank0(f"[resume] skipping {path}: {problem}")
    dist.print_rank0(f"[resume] no complete training state under {Path(output_dir) / STATE_DIR}; starting from the beginning")
    return None


def pick_state(resume: Optional[str], output_dir: str) -> Optional[str]:
    """The training state ``--resume`` names (``auto``: the newest complete one under ``output_dir``),
    as rank 0 found it, or None. Collective."""
    path = _pick_local(resume, output_dir)
    return dist.broadcast_object(str(path) if path else None)


KEPT_BATCH = "the global batch is kept by changing the per-rank micro-batch or the gradient accumulation"


def world_size_refusal(path: Any, saved_world: int, world: int, supported: bool, kept: str = KEPT_BATCH) -> str:
    """The message of a refused resume on another number of ranks (``kept``: what the program keeps, and how,
    where it is allowed)."""
    if not supported:
        return (f"--resume {path}: the run was saved with {saved_world} ranks and this one has {world}, and this "
                f"program resumes on the same number of ranks only: start {saved_world} ranks (--num_gpus / --num_nodes).")
    return (f"--resume {path}: the run was saved with {saved_world} ranks and this one has {world}. A training state "
            f"resumes on the same number of ranks unless --resume_allow_world_size_change is passed "
            f"(--resume_allow_config_change does not cover it); then the ZeRO state is re-partitioned, {kept}, and "
            f"the run is no longer bit-identical to an uninterrupted one. Pass --resume_allow_world_size_change, or "
            f"start {saved_world} ranks (--num_gpus / --num_nodes).")


class RunState:
    """Saves and restores the training state of one run. All methods are collective."""

    def __init__(self, output_dir: str, engines: dict[str, Any], config: dict, *, save_interval: int = 0,
                 keep_last_k: int = 2, resume: Optional[str] = None, allow_config_change: bool = False):
        self.root = Path(output_dir) / STATE_DIR
        self.output_dir = output_dir
        self.engines = engines
        self.config = config
        self.save_interval = save_interval
        self.keep_last_k = keep_last_k
        self.resume = resume
        self.allow_config_change = allow_config_change
        self.last_saved: Optional[Path] = None
        self.logger: Optional[Any] = None  # a MetricsLogger: its tracker run ids are saved and restored
        # the program's batch layout (rlhfkit.resume_reshard.resume_layout, rlhfkit.ppo.reshard.resume_layout),
        # which also holds the state it picked; only with one may a state of another world size be resumed
        self.layout: Optional[Any] = None

    # -- choosing the state to resume from ------------------------------------------------------

    def _check_config(self, saved: dict, path: Path) -> None:
        if saved.get("world_size") != dist.world_size():  # --resume_allow_config_change does not waive this
            supported = self.layout is not None
            if not (supported and self.config.get("resume_allow_world_size_change")):
                raise CheckpointError(world_size_refusal(path, saved.get("world_size"), dist.world_size(), supported))
        old, new = saved.get("config", {}), self.config
        diff = sorted(k for k in set(old) | set(new) if k not in FREE_FIELDS and old.get(k) != new.get(k))
        if not diff:
            return
        msg = "changed: " + ", ".join(f"--{k} {old.get(k)!r} -> {new.get(k)!r}" for k in diff)
        fixed = layout_changes(old, new)
        if fixed:
            raise CheckpointError(
                f"--resume {path}: its engine states were saved with " + ", ".join(f"--{k} {old[k]}" for k in fixed) +
                " and cannot be loaded with " + ", ".join(f"--{k} {new[k]}" for k in fixed) + " (DeepSpeed's saved "
                "files differ between ZeRO-0, ZeRO-1/2 and ZeRO-3, between dtypes, and with other LoRA adapters; "
                "--resume_allow_config_change does not cover it). Resume with the saved values")
        if self.allow_config_change:
            dist.print_rank0(f"[resume] {path}: {msg} (allowed by --resume_allow_config_change)")
            return
        raise CheckpointError(f"--resume {path}: the configuration does not match the saved run ({msg}); "
                              "resume with the same settings, or pass --resume_allow_config_change")

    def restore(self) -> Optional[dict]:
        """Load the chosen state into the engines and the RNGs; return its counters and extras."""
        path = self.layout.state if self.layout is not None else pick_state(self.resume, self.output_dir)
        if path is None:
            return None
        path = Path(path)
        saved = json.loads((path / STATE_FILE).read_text())
        self._check_config(saved, path)
        saved_world = saved["world_size"]
        if saved_world != dist.world_size():
            saved["counters"] = self.layout.load_resharded(self.engines, path, saved["counters"])
        else:
            self._load_engines(path)
        r = dist.rank() % saved_world  # another world size: new rank r takes saved rank r % N's streams
        _set_rng_state(torch.load(path / f"rng_rank{r}.pt", weights_only=True))
        extra_file = path / f"extra_rank{r}.pt"
        saved["rank_extra"] = torch.load(extra_file, weights_only=True) if extra_file.exists() else {}
        if self.logger is not None:
            self.logger.resume_trackers(saved.get("trackers", {}))
        dist.print_rank0(f"[resume] continuing from {path} (step {saved['counters']['step']})")
        return saved

    def _load_engines(self, path: Path) -> None:
        for name, engine in self.engines.items():
            load_path, _ = engine.load_checkpoint(str(path / name), tag="ds", load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
            if load_path is None:
                raise CheckpointError(f"--resume {path}: DeepSpeed could not load the {name} engine state")

    # -- saving ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return bool(self.save_interval) and step % self.save_interval == 0

    def save(self, step: int, counters: dict, extra: Optional[dict] = None, rank_extra: Optional[dict] = None) -> Path:
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        if dist.is_main():
            check_free_space(self.root.parent, sum(estimate_bytes(e.module) * 4 for e in self.engines.values()))
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        for name, engine in self.engines.items():
            engine.save_checkpoint(str(tmp / name), tag="ds")
        r = dist.rank()
        torch.save(_rng_state(), tmp / f"rng_rank{r}.pt")
        if rank_extra:
            torch.save(rank_extra, tmp / f"extra_rank{r}.pt")
        dist.barrier()
        if dist.is_main():
            state = {"counters": {"step": step, **counters}, "extra": extra or {}, "config": self.config,
                     "world_size": dist.world_size(), "files": _files_with_hashes(tmp),
                     "trackers": self.logger.tracker_ids() if self.logger is not None else {}}
            if self.layout is not None:
                state["layout"] = self.layout.to_json()
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
            _fsync_tree(tmp)  # on a network file system the rename must not overtake the data
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            for old in find_states(self.output_dir)[:-self.keep_last_k] if self.keep_last_k > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        self.last_saved = final
        return final
