"""ZeRO's all-gather and reduce-scatter through DeepSpeed's shared-memory all-reduce, when every rank is on
one CPU host.

On DeepSpeed's CPU accelerator the collectives go through gloo, over loopback TCP. DeepSpeed also builds a
shared-memory all-reduce for CPU hosts (``inference_all_reduce``: each rank writes its data into a /dev/shm
buffer that every rank maps, and the ranks sum it there in fp32), but ZeRO's two collectives of every
step, the parameter all-gather and the gradient reduce-scatter, never use it. Here both are rebuilt on it:

- all-gather: this rank's shard goes into its slot (ZeRO-3 often hands it over already there), the other
  slots are filled with -0.0 and the whole is summed over ranks. ``x + (-0.0) == x`` for every x, so each
  value is gloo's (only the sign of a zero can differ: DeepSpeed's kernel starts the last few elements of a
  slice from +0.0).
- reduce-scatter (sum): the input is summed over ranks in chunks through one scratch buffer and each rank
  keeps its own slice. The sum of two ranks is one fp32 addition rounded once, as in gloo; with more
  ranks the order of the additions may differ from gloo's.

Anything else (another dtype, op or group, a non-contiguous tensor, a host without the shared-memory
all-reduce or its vector kernels) goes to the functions they replace. ``install`` swaps them on
DeepSpeed's communication backend; ``RLHFKIT_SHM_COLLECTIVES=0`` keeps gloo's.

DeepSpeed's kernel waits for its peers in a spin loop without a timeout, where gloo would raise when a
peer dies or stops answering. A watchdog thread keeps that promise: when this rank has been inside a
shared-memory collective for a few seconds while a peer process is gone, or for longer than the
collective timeout (``--dist_timeout_s``), it prints the programs' one-line collective error and ends
the process (exit code 3, as the programs do for a failed gloo collective).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

# dtype -> the vector-kernel level DeepSpeed's shm reduce needs (its bf16/fp16 kernels use AVX-512BW)
KERNEL_LEVEL = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}
SCRATCH_BYTES = 32 << 20  # one chunk of a reduce-scatter: the size of DeepSpeed's own shm chunks
PEER_GONE_S = 5.0  # inside one collective this long with a peer process gone: it can never finish


class _Done:
    """The handle of a collective that has already finished (an ``async_op=True`` caller waits on it)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class ShmCollectives:
    """``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with gloo's signatures, over ``all_reduce_``
    (an in-place sum over all ranks of a contiguous CPU tensor)."""

    def __init__(self, all_reduce_: Callable[[torch.Tensor], Any], level: int, rank: int, world: int,
                 all_gather: Callable, reduce_scatter: Callable):
        self.all_reduce_, self.level, self.rank, self.world = all_reduce_, level, rank, world
        self.fallback_gather, self.fallback_scatter = all_gather, reduce_scatter
        self.scratch: dict[torch.dtype, torch.Tensor] = {}
        self.whole_world: dict[Any, bool] = {}
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "fallback": 0}
        self.entered: float | None = None  # monotonic time this rank entered the running shm all-reduce

    def _sum(self, t: torch.Tensor) -> None:
        self.entered = time.monotonic()
        self.all_reduce_(t)
        self.entered = None

    def _covers_world(self, group: Any) -> bool:
        if group is None or group is dist.group.WORLD:
            return True
        if group not in self.whole_world:
            self.whole_world[group] = dist.get_process_group_ranks(group) == list(range(self.world))
        return self.whole_world[group]

    def _usable(self, group: Any, *tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return (self._covers_world(group) and self.level >= KERNEL_LEVEL.get(dtype, 99)
                and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors))

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                               async_op: bool = False):
        n = input_tensor.numel()
        out = output_tensor.view(-1)
        mine = out[self.rank * n:(self.rank + 1) * n]
        if not (self._usable(group, output_tensor, input_tensor) and out.numel() == n * self.world
                and _apart_or_same(input_tensor, out, mine)):
            self.calls["fallback"] += 1
            return self.fallback_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        self.calls["all_gather"] += 1
        if input_tensor.data_ptr() != mine.data_ptr():  # ZeRO-3 passes its shard as a view of this very slot
            mine.copy_(input_tensor.view(-1))
        out[:self.rank * n].fill_(-0.0)
        out[(self.rank + 1) * n:].fill_(-0.0)
        self._sum(out)
        return _Done() if async_op else None

    def reduce_scatter_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
        n = output_tensor.numel()
        if not (op == dist.ReduceOp.SUM and self._usable(group, output_tensor, input_tensor)
                and input_tensor.numel() == n * self.world):
            self.calls["fallback"] += 1
            return self.fallback_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.calls["reduce_scatter"] += 1
        src, out = input_tensor.view(-1), output_tensor.view(-1)
        mine = (self.rank * n, (self.rank + 1) * n)
        scratch = self._scratch(input_tensor.dtype)
        for start in range(0, src.numel(), scratch.numel()):
            stop = min(start + scratch.numel(), src.numel())
            chunk = scratch[:stop - start]
            chunk.copy_(src[start:stop])
            self._sum(chunk)
            lo, hi = max(start, mine[0]), min(stop, mine[1])
            if lo < hi:
                out[lo - mine[0]:hi - mine[0]].copy_(chunk[lo - start:hi - start])
        return _Done() if async_op else None

    def _scratch(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.scratch:
            self.scratch[dtype] = torch.empty(SCRATCH_BYTES // (torch.finfo(dtype).bits // 8), dtype=dtype)
        return self.scratch[dtype]


def _apart_or_same(src: torch.Tensor, out: torch.Tensor, slot: torch.Tensor) -> bool:
    """``src`` shares no memory with ``out``, or is exactly ``slot`` (an in-place all-gather)."""
    start, size = src.data_ptr(), src.numel() * src.element_size()
    out_start, out_size = out.data_ptr(), out.numel() * out.element_size()
    same = start == slot.data_ptr() and size == slot.numel() * slot.element_size()
    return same or start + size <= out_start or out_start + out_size <= start


def shm_all_reduce(backend: Any) -> tuple[Callable[[torch.Tensor], Any] | None, int]:
    """DeepSpeed's shared-memory all-reduce and its vector-kernel level, or (None, 0) where it cannot run:
    no built op, or ranks on more than one host (DeepSpeed maps the buffers only when LOCAL_SIZE, which its
    launcher sets, equals the world size)."""
    op = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
    if getattr(backend, "shm_comm_op", None) is None or op is None:
        return None, 0
    if os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return None, 0
    return op, int(getattr(backend, "shm_vector_kernel_level", 0))


def install(timeout_s: float, on_stuck: Callable[[str], None]) -> ShmCollectives | None:
    """Route DeepSpeed's all-gather and reduce-scatter through shared memory where they can go, with a
    watchdog (``timeout_s``: the collective timeout; ``on_stuck(why)`` ends the process); the installed
    object (its ``calls`` count what took which path), or None when nothing changed. Collective: every
    rank of the world calls it."""
    import deepspeed.comm.comm as ds_comm

    backend = ds_comm.cdb
    if (os.environ.get("RLHFKIT_SHM_COLLECTIVES", "1") == "0" or backend is None or dist.get_world_size() < 2
            or dist.get_backend() != "gloo" or isinstance(backend.all_gather_function, _Bound)):
        return None
    all_reduce_, level = shm_all_reduce(backend)
    usable = (all_reduce_ is not None and backend.all_gather_function is not None
              and backend.reduce_scatter_function is not None)
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (os.getpid(), usable))  # every rank decides the same, and learns its peers
    if not all(ok for _, ok in peers):
        return None
    shm = ShmCollectives(all_reduce_, level, dist.get_rank(), dist.get_world_size(),
                         backend.all_gather_function, backend.reduce_scatter_function)
    backend.all_gather_function = _Bound(shm.all_gather_into_tensor, shm)
    backend.reduce_scatter_function = _Bound(shm.reduce_scatter_tensor, shm)
    pids = [pid for r, (pid, _) in enumerate(peers) if r != shm.rank]
    watchdog = threading.Thread(target=_watch, args=(shm, pids, timeout_s, on_stuck), name="rlhfkit-shm-watchdog",
                                daemon=True)
    watchdog.start()
    return shm


def _gone(pid: int) -> bool:
    """The process has exited (a zombie its launcher has not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _watch(shm: ShmCollectives, pids: list[int], timeout_s: float, on_stuck: Callable[[str], None],
           period_s: float = 1.0) -> None:
    """Once a ``period_s``: call ``on_stuck`` when this rank's running shm collective can no longer finish."""
    while True:
        time.sleep(period_s)
        since = shm.entered
        waited = time.monotonic() - since if since is not None else 0.0
        if since is None or waited < PEER_GONE_S:
            continue
        gone = [pid for pid in pids if _gone(pid)]
        if gone or waited > timeout_s:
            on_stuck(f"peer process {gone[0]} is gone" if gone else f"no answer for {waited:.0f} s")


class _Bound:
    """A replaced backend function that remembers its ShmCollectives (so ``install`` runs once)."""

    def __init__(self, fn: Callable, owner: ShmCollectives):
        self.fn, self.owner = fn, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
