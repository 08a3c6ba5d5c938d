"""Process-group set-up and small collective helpers.

Works the same under ``deepspeed`` (CUDA + NCCL, or DeepSpeed's CPU accelerator + gloo) and in a
plain single process (no launcher: world size 1, nothing initialised).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import random
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def on_cuda() -> bool:
    """True when DeepSpeed's accelerator is CUDA (False on its CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cuda":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def init(timeout_s: int = 600) -> torch.device:
    """Initialise the process group (once) with a collective timeout and return this rank's device.

    A single process started without a launcher gets a world of one (a local gloo/nccl group on a
    free port) so that DeepSpeed engines can be built the same way everywhere.
    """
    import deepspeed

    if "RANK" not in os.environ:  # plain `python step1_sft/main.py`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if not is_initialized():
        deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(remove_shm_buffers)
        if dist.get_backend() == "gloo":  # DeepSpeed's CPU accelerator: its /dev/shm buffers, mapped at init
            # every rank has mapped every other's buffer before any rank can exit and remove its own (DeepSpeed's
            # init waits for the files without a timeout: a peer gone early would hang it for good)
            dist.barrier()
        from rlhfkit import shm_collectives

        stuck = functools.partial(end_after_failed_collective, "shared-memory collective")
        if shm_collectives.install(timeout_s, on_stuck=stuck) is not None:
            print_rank0("collectives: ZeRO's all-gather and reduce-scatter go through shared memory "
                        "(one host; RLHFKIT_SHM_COLLECTIVES=0: gloo)")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def end_after_failed_collective(kind: str, detail: str) -> None:
    """A collective failed because a peer rank died or hung: say so in one line, remove this rank's
    shared-memory buffers and end the process with exit code 3 (``program.run_main`` for a gloo/NCCL
    error, the shared-memory collectives' watchdog for a stuck one)."""
    print(f"error: rank {rank()} of {world_size()}: a collective operation failed, so another rank died, was killed or "
          f"stopped answering (timeout --dist_timeout_s); stopping. ({kind}: {detail})", file=sys.stderr, flush=True)
    remove_shm_buffers()
    os._exit(3)


def shm_buffer_glob(port: str | int | None = None, rank: str | int = "*") -> str:
    """DeepSpeed's CPU accelerator keeps its all-reduce buffer in a /dev/shm file per rank and never
    deletes it (each holds ~66 MB of RAM until removed)."""
    port = port if port is not None else os.environ.get("MASTER_PORT", "*")
    return f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{rank}"


def remove_shm_buffers(port: str | int | None = None, rank: str | int | None = None) -> None:
    import glob

    for path in glob.glob(shm_buffer_glob(port, os.environ.get("LOCAL_RANK", "0") if rank is None else rank)):
        try:
            os.unlink(path)
        except OSError:
            pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    """All-reduce a copy of ``t``; CPU tensors travel through the accelerator when the backend is NCCL."""
    out = t.detach().clone()
    if not (is_initialized() and world_size() > 1):
        return out
    if out.device.type == "cpu" and dist.get_backend() == "nccl":
        moved = out.to(device())
        dist.all_reduce(moved, op=op)
        return moved.to(out.device)
    dist.all_reduce(out, op=op)
    return out


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor; ``t`` is untouched)."""
    return _reduce(t, dist.ReduceOp.SUM)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(t) / world_size()


def mean_over_ranks(values: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    """Average a dict of python floats over ranks (one collective)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    t = all_reduce_mean(t)
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def gather_lists(items: list) -> list:
    """Every rank's list of picklable items, concatenated in rank order (the same on every rank)."""
    if not (is_initialized() and world_size() > 1):
        return list(items)
    boxes: list = [None] * world_size()
    dist.all_gather_object(boxes, list(items))
    return [x for box in boxes for x in box]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not (is_initialized() and world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_rank0(*args: Any, **kwargs: Any) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise max of ``t`` over ranks (a new tensor)."""
    return _reduce(t, dist.ReduceOp.MAX)


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    return -all_reduce_max(-t)


def max_over_ranks(values: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    """Max of a dict of python floats over ranks (one collective)."""
    if not values:
        return {}
    keys = sorted(values)
    t = all_reduce_max(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device))
    return {k: float(v) for k, v in zip(keys, t.tolist())}
