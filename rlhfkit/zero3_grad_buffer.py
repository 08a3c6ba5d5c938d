"""ZeRO-3's fp32 gradient partition in one buffer that the process keeps, instead of a fresh one each step.

Before each optimizer step DeepSpeed's ZeRO-3 optimizer flattens a rank's reduced gradient partition
(bf16/fp16 pieces) into a new tensor and converts that to a second new tensor in fp32, the gradient of
its flat fp32 master partition (``_prepare_fp32_grad_for_sub_group``); after the step it drops it. For a
model of N parameters on W ranks that is 2N/W and 4N/W bytes a rank each step, for any model of note
above glibc's largest mmap threshold (:mod:`rlhfkit.host_memory`), so each step maps them fresh from
the kernel and pays a page fault and a zeroed page every 4 KiB (README, "Speed on the CPU").

:func:`install` replaces that method with one that copies each piece, converted, straight into one fp32
buffer, kept by the process and shared by every ZeRO-3 engine in it (the actor's and the critic's steps
run one after the other, and DeepSpeed drops the fp32 gradient at the end of each sub-group's update).
The values are the same: one bf16 -> fp32 conversion of the same pieces in the same order. The buffer
grows to the largest sub-group partition and stays (4N/W bytes between steps, where the method it
replaces needed 6N/W during each step). Host memory only (a CUDA caching allocator already reuses);
offloaded and swapped optimizers never call the method. ``RLHFKIT_KEEP_FREED_MEMORY=0`` leaves
DeepSpeed's own method, as it leaves glibc's thresholds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlhfkit import host_memory

METHOD = "_prepare_fp32_grad_for_sub_group"  # of DeepSpeedZeroOptimizer_Stage3
_KEPT: dict[torch.dtype, torch.Tensor] = {}
_ORIGINAL: dict[str, Callable] = {}  # METHOD -> DeepSpeed's own, while replaced


def install() -> bool:
    """Replace ZeRO-3's fp32 gradient preparation (once per process) -> whether it is replaced."""
    if not host_memory.wanted():
        return False
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    if not hasattr(Stage3, METHOD):  # another DeepSpeed: its own method stands
        return False
    if METHOD not in _ORIGINAL:
        _ORIGINAL[METHOD] = getattr(Stage3, METHOD)
        setattr(Stage3, METHOD, prepare_fp32_grad_for_sub_group)
    return True


def uninstall() -> None:
    """Put DeepSpeed's own method back (tests compare the two)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    for name, fn in _ORIGINAL.items():
        setattr(Stage3, name, fn)
    _ORIGINAL.clear()
    _KEPT.clear()


def prepare_fp32_grad_for_sub_group(opt: Any, sub_group_id: int) -> None:
    """DeepSpeed's method, with the fp32 gradient written into the kept buffer."""
    flat = opt.fp32_partitioned_groups_flat[sub_group_id]
    pieces = opt.averaged_gradients[sub_group_id]
    if flat.device.type != "cpu" or not pieces:
        return _ORIGINAL[METHOD](opt, sub_group_id)
    grad = kept_buffer(flat.numel(), flat.dtype)
    offset = 0
    for piece in pieces:
        grad[offset:offset + piece.numel()].copy_(piece.reshape(-1))
        offset += piece.numel()
    if offset != flat.numel():
        raise AssertionError(f"averaged gradients have {offset} elements, the fp32 partition of sub-group "
                             f"{sub_group_id} has {flat.numel()}")
    flat.grad = grad
    opt.averaged_gradients[sub_group_id] = None


def kept_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of the process's kept buffer of ``dtype`` (grown when too small)."""
    buf = _KEPT.get(dtype)
    if buf is None or buf.numel() < numel:
        _KEPT.pop(dtype, None)  # the old one goes before the larger one comes
        buf = _KEPT[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
