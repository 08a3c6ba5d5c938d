"""Fault injection for tests: environment variables that make the real programs crash or see a NaN
loss at a chosen point, so the recovery paths (resume, skip-and-stop) run through the real code."""

from __future__ import annotations

import os

from rlhfkit import distributed as dist

_CRASH_COUNTS: dict[str, int] = {}


def crash_point(where: str) -> None:
    """``RLHFKIT_FAULT_KILL=<where>:<n>`` SIGKILLs rank 0 the n-th time it reaches ``where``
    ("train_step" in the supervised loop, "generation" in step 3's rollouts), so a crash mid-run is
    reproducible."""
    spec = os.environ.get("RLHFKIT_FAULT_KILL", "")
    if not spec or not dist.is_main():
        return
    name, _, n = spec.partition(":")
    if name != where:
        return
    _CRASH_COUNTS[where] = _CRASH_COUNTS.get(where, 0) + 1
    if _CRASH_COUNTS[where] == int(n or 1):
        import signal

        print(f"[fault injection] SIGKILL at {where} #{n}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def nonfinite_injected(counter: int) -> bool:
    """``RLHFKIT_FAULT_NAN_AT=3,4`` makes the 3rd and 4th loss (counted from 1 in this process) NaN, so
    the skip-and-stop path runs through the real program."""
    spec = os.environ.get("RLHFKIT_FAULT_NAN_AT", "")
    return bool(spec) and str(counter) in spec.split(",")
