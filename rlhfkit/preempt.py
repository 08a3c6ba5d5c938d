"""Preemption: a scheduler's signal ends a run with a saved training state, on every rank together.

A handler for each of ``--preempt_signals`` (default SIGTERM and SIGUSR1: SLURM's ``scancel`` and
``--signal``) only records the signal; training goes on to the end of the optimiser step it is in.
There the loop asks :func:`stop_requested`, a collective (an all-reduce of every rank's flag), so all
ranks agree even when only some got the signal. Then the loop saves a training state (the usual atomic
save) and raises :class:`Preempted`, which ``run_main`` turns into one line naming the state and the
exit status :data:`PREEMPTED_EXIT`. A second signal while saving is ignored.

Exit status 75 (EX_TEMPFAIL, "try again later"): not 0, so a pipeline script does not go on to the next
stage as if the stage had finished, and not a failure: ``launch/*.sh`` and a SLURM requeue script can
tell it apart. Under ``deepspeed``'s launcher, which SIGTERMs each rank in turn and SIGKILLs it 30 s
later, the step and the save must fit in those 30 s. With ``SLURM_RESTART_COUNT`` > 0 (a requeued job)
a program resumes by itself (``--resume auto``).
"""

from __future__ import annotations

import os
import signal
from typing import Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.errors import ConfigError, RlhfkitError

PREEMPTED_EXIT = 75
_RECEIVED: dict[str, Optional[int]] = {"signum": None}


class Preempted(RlhfkitError):
    """The run stopped on a preemption signal after saving a training state."""


def install(names: str) -> list[int]:
    """Catch the comma-separated signals (``"SIGTERM,SIGUSR1"``; ``"none"``: none). Returns their numbers."""
    nums = []
    for name in (n.strip().upper() for n in names.split(",") if n.strip() and n.strip().lower() != "none"):
        num = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(num, signal.Signals) or num in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"--preempt_signals {names}: {name} is not a signal that can be caught")
        signal.signal(num, _record)
        nums.append(int(num))
    return nums


def _record(signum: int, frame) -> None:
    if _RECEIVED["signum"] is None:
        _RECEIVED["signum"] = signum
        print(f"[preempt] rank {dist.rank()}: {signal.Signals(signum).name} received; saving a training state at the "
              "end of this step", flush=True)


def received() -> Optional[int]:
    """The signal this rank got, if any (not collective)."""
    return _RECEIVED["signum"]


def stop_requested() -> bool:
    """Collective: whether any rank got a preemption signal. Every rank calls it at the same points."""
    flag = torch.tensor([1.0 if _RECEIVED["signum"] is not None else 0.0], device=dist.device())
    return bool(dist.all_reduce_sum(flag).item() > 0)


def stop(path: str, step: int) -> Preempted:
    """The :class:`Preempted` to raise once the state at ``path`` is saved."""
    name = signal.Signals(_RECEIVED["signum"]).name if _RECEIVED["signum"] is not None else "a signal on another rank"
    return Preempted(f"preempted by {name} after step {step}: training state saved in {path}; "
                     "run the same command with --resume auto to continue")


def requeued_resume(resume: Optional[str]) -> Optional[str]:
    """``--resume`` as given, or ``auto`` in a requeued SLURM job (SLURM_RESTART_COUNT > 0), said in one line."""
    if resume is None and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        dist.print_rank0(f"[preempt] SLURM_RESTART_COUNT={os.environ['SLURM_RESTART_COUNT']}: a requeued job, so --resume auto")
        return "auto"
    return resume
