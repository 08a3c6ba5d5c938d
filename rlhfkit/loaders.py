"""Data loaders and samplers of the training programs: sharded over ranks, deterministic for a seed,
resumable at a batch.

Under ZeRO-3 every rank takes part in every forward pass, so every loader here gives every rank the
same number of batches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlhfkit import distributed as dist


class ListDataset(Dataset):
    def __init__(self, items: Sequence[Any]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Shuffled, sharded batches of similar length (HF Trainer's ``group_by_length``, made
    distributed): each epoch the rows are shuffled with ``seed + epoch``, cut into mega-batches of
    ``mega`` global batches, each sorted by length and cut into global batches, whose order is shuffled
    again; rank ``rank`` of ``world`` takes its slice of every global batch. Padding shrinks to the
    length spread inside a batch, every rank gets the same number of rows (the tail wraps around), and
    the same-step ranks see similar lengths, so ZeRO-3 ranks wait less for each other.

    ``order_batch`` (default ``batch_size * world``) is the size of the global batches the order is
    built from. A run resumed on another number of ranks (:mod:`rlhfkit.resume_reshard`) passes the
    saved run's, so that the epoch's order of rows is the same; it then cuts that order into its own
    global micro-batches of ``batch_size * world`` rows (which must divide ``order_batch``), and
    rank ``rank`` takes its slice of each."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, *, world: int, rank: int, mega: int = 16,
                 order_batch: Optional[int] = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.lengths, self.batch_size, self.seed, self.mega = list(lengths), batch_size, seed, mega
        self.world, self.rank, self.epoch = world, rank, 0
        self.global_batch = batch_size * world
        self.order_batch = order_batch or self.global_batch
        if self.order_batch % self.global_batch:
            raise ValueError(f"global micro-batch {self.global_batch} does not divide the order's batch {self.order_batch}")
        self.num_batches = max(1, math.ceil(len(self.lengths) / self.order_batch)) * (self.order_batch // self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        total = self.num_batches * self.global_batch
        order = (order * math.ceil(total / max(len(order), 1)))[:total]
        batches = []
        unit = self.order_batch
        span = unit * self.mega
        for start in range(0, total, span):
            chunk = sorted(order[start:start + span], key=lambda i: self.lengths[i], reverse=True)
            batches += [chunk[i:i + unit] for i in range(0, len(chunk), unit)]
        rows = [i for b in torch.randperm(len(batches), generator=g).tolist() for i in batches[b]]
        for start in range(0, total, self.global_batch):
            yield from rows[start + self.rank * self.batch_size:start + (self.rank + 1) * self.batch_size]


def train_loader(features: Sequence[Any], collate: Callable, batch_size: int, seed: int,
                 lengths: Optional[Sequence[int]] = None, order_batch: Optional[int] = None) -> DataLoader:
    """A shuffled loader sharded over ranks; every rank gets the same number of batches (ZeRO-3
    needs all ranks in every forward pass), deterministic for a seed (call ``set_epoch``). With
    ``lengths``, batches group rows of similar length (less padding, same rows per epoch), in the
    order built from global batches of ``order_batch`` rows (:class:`LengthGroupedSampler`)."""
    if lengths is not None:
        sampler = LengthGroupedSampler(lengths, batch_size, seed, world=dist.world_size(), rank=dist.rank(),
                                       order_batch=order_batch)
    else:
        if order_batch not in (None, batch_size * dist.world_size()):
            raise ValueError("a data order of another world size needs the length-grouped sampler")
        sampler = DistributedSampler(ListDataset(features), num_replicas=dist.world_size(), rank=dist.rank(), shuffle=True,
                                     seed=seed, drop_last=False)
    # Its own generator: a DataLoader otherwise draws a seed from the global RNG each time an epoch
    # starts, which would make sampling after a resume differ from the uninterrupted run.
    return DataLoader(ListDataset(features), batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=False,
                      generator=torch.Generator().manual_seed(seed))


def eval_batches(features: Sequence[Any], collate: Callable, batch_size: int) -> Iterable[tuple[Any, torch.Tensor]]:
    """This rank's evaluation batches with a 0/1 weight per row. Every rank takes ceil(n / world) rows, the
    last ranks' shares filled up with weight-0 copies (at most world - 1 of them), in batches of
    ``batch_size`` and a smaller last one: every rank runs the same batches and no row counts twice. (A
    set smaller than a batch is not padded up to one: 2 held-out rows of 2048 tokens were 8 per rank.)"""
    n, world, r = len(features), dist.world_size(), dist.rank()
    per_rank = math.ceil(n / world)
    idx = list(range(r * per_rank, (r + 1) * per_rank))
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        rows = [features[i] if i < n else features[0] for i in chunk]
        weights = torch.tensor([1.0 if i < n else 0.0 for i in chunk])
        yield collate(rows), weights


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def feature_length(f: dict) -> int:
    """Tokens of one training row (the longer side of a pair; a KTO completion with its prompt)."""
    if "input_ids" in f:
        return len(f["input_ids"])
    if "completion_ids" in f:
        return len(f["prompt_ids"]) + len(f["completion_ids"])
    return max(len(f["chosen_input_ids"]), len(f["rejected_input_ids"]))


class BatchStream:
    """Endless batches from a sharded loader, reshuffled each epoch, with a position (epoch, index)
    that a training state records and a resumed run continues from."""

    def __init__(self, loader: DataLoader, epoch: int = 0, index: int = 0):
        self.loader, self.epoch, self.index = loader, epoch, index
        self._it: Optional[Iterator] = None

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                if hasattr(self.loader.sampler, "set_epoch"):
                    self.loader.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
                for _ in range(self.index):  # skip what was already consumed before a resume
                    next(self._it)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it, self.epoch, self.index = None, self.epoch + 1, 0
                continue
            self.index += 1
            return batch

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}
