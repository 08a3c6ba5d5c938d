"""ZeRO's all-gather and reduce-scatter through shared memory, when every rank is on one CPU host.

On DeepSpeed's CPU accelerator the collectives go through gloo, over loopback TCP. Here ZeRO's two
collectives of every step, the parameter all-gather and the gradient reduce-scatter, go through a region
of /dev/shm that every rank maps (made at ``install``, unlinked as soon as every rank has mapped it, so
nothing is left behind even if a rank is killed). The ranks wait for each other with DeepSpeed's own
shared-memory all-reduce (``inference_all_reduce``, built for CPU hosts) on a tiny tensor: a spin barrier.

- all-gather: each rank copies its shard into its slot of the region, the ranks meet, and each copies
  every slot out: gloo's bits, moved once.
- reduce-scatter (sum): each rank copies its whole input into its slot, the ranks meet, and each sums
  its own slice over the ranks' slots. Two ranks' values are added once and rounded once (bf16 and fp16
  in fp32, as torch adds them), as gloo does; with more ranks the sum is taken in fp32 in rank order and
  rounded once, where gloo's order may differ.

Large tensors go in pieces; the region holds two buffers used in turn, so a rank can fill the next one
while a slower rank still reads the last. (Before, both collectives were sums through DeepSpeed's
all-reduce: an all-gather filled the other slots with -0.0 and summed the whole, twice the traffic.)

Anything else (another dtype, op or group, a non-contiguous or overlapping tensor, a host without the
shared-memory all-reduce or /dev/shm) goes to the functions they replace. ``install`` swaps them on
DeepSpeed's communication backend; ``RLHFKIT_SHM_COLLECTIVES=0`` keeps gloo's.

DeepSpeed's kernel waits for its peers in a spin loop without a timeout, where gloo would raise when a
peer dies or stops answering. A watchdog thread keeps that promise: when this rank has been inside a
shared-memory collective for a few seconds while a peer process is gone, or for longer than the
collective timeout (``--dist_timeout_s``), it prints the programs' one-line collective error and ends
the process (exit code 3, as the programs do for a failed gloo collective).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BUFFER_BYTES = 32 << 20  # each of the region's two buffers; a collective larger than that goes in pieces
PEER_GONE_S = 5.0  # inside one collective this long with a peer process gone: it can never finish


class _Done:
    """The handle of a collective that has already finished (an ``async_op=True`` caller waits on it)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class ShmCollectives:
    """``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with gloo's signatures, through ``region``
    (a uint8 tensor of two buffers of ``BUFFER_BYTES`` that every rank maps) and ``all_reduce_`` (an
    in-place sum over all ranks of a contiguous CPU tensor: the barrier)."""

    def __init__(self, all_reduce_: Callable[[torch.Tensor], Any], region: torch.Tensor, rank: int, world: int,
                 all_gather: Callable, reduce_scatter: Callable):
        self.all_reduce_, self.rank, self.world = all_reduce_, rank, world
        self.buffers = region[:2 * BUFFER_BYTES].view(2, BUFFER_BYTES)
        self.fallback_gather, self.fallback_scatter = all_gather, reduce_scatter
        self.fallback_coalesced: Callable = _deepspeed_coalesced()
        self.token = torch.zeros(16)  # what the barrier sums
        self.turn = 0  # which buffer the next piece goes through: the same on every rank
        self.whole_world: dict[Any, bool] = {}
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "fallback": 0}
        self.entered: float | None = None  # monotonic time this rank entered the barrier it waits in
        self.slot_views: dict[tuple, list[list[torch.Tensor]]] = {}  # exchange's views of the buffers' slots, by shape

    def _meet(self) -> None:
        """Wait until every rank has reached this point (each has written its part of the buffer)."""
        self.entered = time.monotonic()
        self.all_reduce_(self.token)
        self.entered = None

    def _buffer(self, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """The next buffer, as ``dtype`` of ``shape`` (from its start)."""
        flat = self.buffers[self.turn % 2].view(dtype)
        self.turn += 1
        return flat[:math.prod(shape)].view(*shape)

    def _covers_world(self, group: Any) -> bool:
        if group is None or group is dist.group.WORLD:
            return True
        if group not in self.whole_world:
            self.whole_world[group] = dist.get_process_group_ranks(group) == list(range(self.world))
        return self.whole_world[group]

    def _usable(self, group: Any, *tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return (self._covers_world(group) and dtype in DTYPES
                and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors))

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                               async_op: bool = False):
        n = input_tensor.numel()
        out = output_tensor.view(-1)
        if not (self._usable(group, output_tensor, input_tensor) and out.numel() == n * self.world
                and _apart_or_same(input_tensor, out, out[self.rank * n:(self.rank + 1) * n])):
            self.calls["fallback"] += 1
            return self.fallback_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        self.calls["all_gather"] += 1
        src, slots = input_tensor.view(-1), out.view(self.world, n)
        # in place (ZeRO's gathers are), this rank's slot holds its shard already: only the others' are copied out
        in_place = src.data_ptr() == slots[self.rank].data_ptr()
        rows = [r for r in range(self.world) if not (in_place and r == self.rank)]
        piece = BUFFER_BYTES // (self.world * input_tensor.element_size())
        for start in range(0, n, piece):
            m = min(piece, n - start)
            buf = self._buffer(input_tensor.dtype, self.world, m)
            buf[self.rank].copy_(src[start:start + m])
            self._meet()
            for r in rows:
                slots[r, start:start + m].copy_(buf[r])
        return _Done() if async_op else None

    def exchange(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``x`` (the same shape and dtype on every rank), concatenated in rank order along
        ``dim``: a new tensor. For the many small exchanges of a shared decode step
        (:mod:`rlhfkit.rollout.shared_decode`): ``x`` copied into this rank's slot, the ranks meet, the
        slots copied out as one tensor. The slots' views are made once per shape."""
        key = (x.shape, x.dtype)
        if key not in self.slot_views:
            n = x.numel() * x.element_size()
            if n * self.world > BUFFER_BYTES:
                raise ValueError(f"exchange of {n} bytes a rank: the shared buffer holds {BUFFER_BYTES // self.world}")
            if len(self.slot_views) >= 64:
                self.slot_views.clear()
            self.slot_views[key] = [[slot.view(x.dtype).view(x.shape) for slot in buf[:n * self.world].view(self.world, n)]
                                    for buf in self.buffers]
        slots = self.slot_views[key][self.turn % 2]
        self.turn += 1
        slots[self.rank].copy_(x)
        self._meet()
        return torch.cat(slots, dim=dim)

    def reduce_scatter_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                              op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
        n = output_tensor.numel()
        out = output_tensor.view(-1)
        if not (op == dist.ReduceOp.SUM and self._usable(group, output_tensor, input_tensor)
                and input_tensor.numel() == n * self.world
                and _apart_or_same(out, input_tensor.view(-1), input_tensor.view(-1)[self.rank * n:(self.rank + 1) * n])):
            self.calls["fallback"] += 1
            return self.fallback_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.calls["reduce_scatter"] += 1
        src = input_tensor.view(self.world, n)
        self._reduce(out, lambda mine, lo, hi: mine.copy_(src[:, lo:hi]))
        return _Done() if async_op else None

    def _reduce(self, out: torch.Tensor, fill: Callable[[torch.Tensor, int, int], Any]) -> None:
        """``out`` = the sum over the ranks of what each rank's ``fill(mine, lo, hi)`` writes into ``mine``
        [world, hi - lo] (row r: its part of the positions lo..hi of rank r's ``out``), piece by piece."""
        piece = BUFFER_BYTES // (self.world * self.world * out.element_size())
        for lo in range(0, len(out), piece):
            hi = min(lo + piece, len(out))
            buf = self._buffer(out.dtype, self.world, self.world, hi - lo)  # [from rank, to rank, position]
            fill(buf[self.rank], lo, hi)
            self._meet()
            _sum_into(out[lo:hi], buf[:, self.rank])

    @torch.no_grad()
    def reduce_scatter_coalesced(self, tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
        """DeepSpeed's ``reduce_scatter_coalesced`` (ZeRO-3's gradient reduction): each tensor cut into
        ``world`` parts of ``ceil(numel / world)`` elements (the last one shorter), this rank's part of each,
        averaged over the ranks. DeepSpeed lays every rank's parts out in one new buffer (a copy), divides
        the whole by ``world`` in place (a pass) and reduce-scatters it; here each part goes from its tensor,
        divided by ``world`` (the same rounding), straight into the shared buffer, and this rank sums its own
        parts there: the same bits, one pass over the gradients. Another group, dtype or layout goes to
        DeepSpeed's own function (``self.fallback_coalesced``)."""
        if not (tensors and self._usable(group, *tensors) and self.installed()):
            self.calls["fallback"] += 1
            return self.fallback_coalesced(tensors, group)
        self.calls["reduce_scatter"] += 1
        world = self.world
        sizes = [-(-t.numel() // world) for t in tensors]  # each tensor's part, padded (DeepSpeed's chunk size)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out = torch.empty(sum(sizes), dtype=tensors[0].dtype)
        self._reduce(out, functools.partial(_divided_parts, tensors, sizes, starts, world))
        mine = [max(0, min(size, t.numel() - self.rank * size)) for t, size in zip(tensors, sizes)]
        return [out.narrow(0, start, n) for start, n in zip(starts, mine)]

    def installed(self) -> bool:
        """DeepSpeed's backend still calls this object's reduce-scatter (a caller may have put gloo's back)."""
        import deepspeed.comm.comm as ds_comm

        return getattr(ds_comm.cdb.reduce_scatter_function, "owner", None) is self


def _divided_parts(tensors: list[torch.Tensor], sizes: list[int], starts: list[int], world: int, mine: torch.Tensor,
                   lo: int, hi: int) -> None:
    """Fill ``mine`` [world, hi - lo] with positions lo..hi of every rank's parts (part r of each tensor at
    its ``start``, ``size`` long, the tail of the last part padding), divided by ``world`` with the rounding
    of DeepSpeed's in-place division. Padding is left as it was: its sums are never returned."""
    for t, size, start in zip(tensors, sizes, starts):
        a, b = max(lo, start), min(hi, start + size)
        for to in range(world) if a < b else ():
            src = t.view(-1)[to * size + a - start:min(to * size + b - start, t.numel())]
            torch.div(src, world, out=mine[to, a - lo:a - lo + len(src)])


def _sum_into(out: torch.Tensor, parts: torch.Tensor) -> None:
    """``out`` = the sum over the rows of ``parts`` [ranks, m], rounded once to ``out``'s dtype."""
    if len(parts) == 2:
        torch.add(parts[0], parts[1], out=out)  # one addition: computed in fp32 for bf16/fp16, rounded once
        return
    total = parts[0].float()
    for row in parts[1:]:
        total += row
    out.copy_(total)


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
    usable = (all_reduce_ is not None and level >= 1 and backend.all_gather_function is not None
              and backend.reduce_scatter_function is not None and os.access("/dev/shm", os.W_OK))
    region = _shared_region(usable)
    if region is None:
        return None
    shm = ShmCollectives(all_reduce_, region, dist.get_rank(), dist.get_world_size(),
                         backend.all_gather_function, backend.reduce_scatter_function)
    backend.all_gather_function = _Bound(shm.all_gather_into_tensor, shm)
    backend.reduce_scatter_function = _Bound(shm.reduce_scatter_tensor, shm)
    import deepspeed.runtime.zero.stage3 as stage3

    stage3.reduce_scatter_coalesced = shm.reduce_scatter_coalesced  # ZeRO-3 looks the name up at each reduction
    pids = [pid for r, pid in enumerate(_all(os.getpid())) if r != shm.rank]
    watchdog = threading.Thread(target=_watch, args=(shm, pids, timeout_s, on_stuck), name="rlhfkit-shm-watchdog",
                                daemon=True)
    watchdog.start()
    return shm


def installed() -> ShmCollectives | None:
    """The collectives :func:`install` put on DeepSpeed's backend in this process, if any."""
    import deepspeed.comm.comm as ds_comm

    return getattr(getattr(ds_comm.cdb, "all_gather_function", None), "owner", None)


def _deepspeed_coalesced() -> Callable:
    """DeepSpeed's own ``reduce_scatter_coalesced`` (what ZeRO-3 calls without this module)."""
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    return reduce_scatter_coalesced


def _all(value: Any) -> list:
    """``value`` of every rank, in rank order (a gloo collective)."""
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _shared_region(usable: bool) -> torch.Tensor | None:
    """Two buffers of ``BUFFER_BYTES`` in a /dev/shm file that every rank maps, or None unless every rank
    is ``usable`` and maps it. Rank 0 makes the file and unlinks it once every rank has mapped it: the
    memory lives as long as the mappings, and nothing is left in /dev/shm. Collective."""
    rank, size = dist.get_rank(), 2 * BUFFER_BYTES
    path = None
    if rank == 0 and usable:
        path = f"/dev/shm/rlhfkit_collectives_{os.getpid()}_{time.time_ns()}"
        try:
            with open(path, "wb") as f:
                f.truncate(size)
        except OSError:
            path = None
    answers = _all((usable, path))
    path = answers[0][1]
    region = None
    if path is not None and all(ok for ok, _ in answers):
        try:
            region = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError):
            region = None
    mapped = _all(region is not None)
    if rank == 0 and path is not None:
        os.unlink(path)
    return region if all(mapped) else None


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
