"""``eval_batches``: every held-out row counts once, every rank runs the same batches, and no rank evaluates
more than its share (ceil(n / world) rows) plus nothing: a small set is not padded up to a whole batch."""

import pytest

from rlhfkit import distributed as dist
from rlhfkit.loaders import eval_batches


def batches_of(n, batch_size, world, rank, monkeypatch):
    monkeypatch.setattr(dist, "world_size", lambda: world)
    monkeypatch.setattr(dist, "rank", lambda: rank)
    return [(rows, weights.tolist()) for rows, weights in eval_batches(list(range(n)), list, batch_size)]


def test_five_rows_two_ranks_batches_of_two(monkeypatch):
    # hand layout: rank 0 takes rows 0-2, rank 1 rows 3-4 and one weight-0 copy of row 0
    assert batches_of(5, 2, 2, 0, monkeypatch) == [([0, 1], [1.0, 1.0]), ([2], [1.0])]
    assert batches_of(5, 2, 2, 1, monkeypatch) == [([3, 4], [1.0, 1.0]), ([0], [0.0])]


def test_a_set_smaller_than_a_batch_is_not_padded_up_to_one(monkeypatch):
    assert batches_of(2, 8, 2, 0, monkeypatch) == [([0], [1.0])]
    assert batches_of(2, 8, 2, 1, monkeypatch) == [([1], [1.0])]


@pytest.mark.parametrize("n,batch_size,world", [(227, 8, 2), (64, 8, 2), (7, 3, 4), (1, 8, 2), (0, 4, 2), (10, 4, 1)])
def test_every_row_once_same_batches_on_every_rank(n, batch_size, world, monkeypatch):
    per_rank = [batches_of(n, batch_size, world, r, monkeypatch) for r in range(world)]
    counted = sorted(row for mine in per_rank for rows, weights in mine for row, w in zip(rows, weights) if w == 1.0)
    assert counted == list(range(n))
    shapes = [[len(rows) for rows, _ in mine] for mine in per_rank]
    assert all(s == shapes[0] for s in shapes)
    assert sum(shapes[0]) == -(-n // world)
    assert all(size <= batch_size for size in shapes[0])
