"""Keep freed host memory in the process (glibc's malloc) instead of handing it back to the kernel.

Every training step on the CPU allocates and frees the same large tensors: activations, logits, the
fp32 copies of the gradients that DeepSpeed's bf16 optimizer wrapper makes each step. glibc returns
freed memory at the top of its heap to the kernel once more than ``M_TRIM_THRESHOLD`` is free there,
and its dynamic thresholds let that happen every step, so the next step takes every page again from
the kernel: a page fault and a zeroed page each 4 KiB, for memory the process needs again at once.

:func:`keep_freed_memory` fixes the thresholds with ``mallopt``, as ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` in the environment would: freed memory stays in the heap for the next
step (the process keeps its high-water mark, which the step reaches anyway), and blocks of 32 MiB
and more are still mapped apart and returned when freed, so that one large temporary cannot leave
a heap that fragments. The programs call it at start-up when their tensors live in host memory
(:func:`rlhfkit.program.join_process_group`, part of ``start_program``), and the ``rlhfkit``
command always. ``RLHFKIT_KEEP_FREED_MEMORY=0`` turns it off (bench/grpo.py --variant
'off=RLHFKIT_KEEP_FREED_MEMORY=0' measures the difference); so do malloc settings of your own
(``MALLOC_*``, ``GLIBC_TUNABLES``, a preloaded jemalloc or tcmalloc), and a C library other than
glibc leaves it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

from rlhfkit.errors import ConfigError

ENV = "RLHFKIT_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (64-bit): larger blocks are mapped and unmapped on their own
TRIM_NEVER = -1  # mallopt(3): "-1 disables trimming completely"


def wanted() -> bool:
    """Whether ``RLHFKIT_KEEP_FREED_MEMORY`` asks to keep freed host memory (the default: yes)."""
    choice = os.environ.get(ENV, "1").strip().lower()
    if choice not in ("0", "1", "false", "true", "off", "on"):
        raise ConfigError(f"{ENV}={choice!r}: use 1 (keep freed memory in the process) or 0")
    return choice in ("1", "true", "on")


def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds for this process where wanted -> whether they are set."""
    if not wanted() or own_malloc_settings():
        return False
    return _set_thresholds()


@functools.cache
def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def own_malloc_settings() -> bool:
    """Whether the user tuned malloc already (glibc's ``MALLOC_*`` variables or ``GLIBC_TUNABLES``, or
    another allocator preloaded): theirs stands."""
    return (any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
            or "alloc" in os.environ.get("LD_PRELOAD", ""))
