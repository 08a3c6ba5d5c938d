"""The length-grouped distributed sampler: same rows on every rank count, full coverage, determinism."""

import pytest

from rlhfkit.training import LengthGroupedSampler


def rank_orders(lengths, batch, world, seed=7, epoch=0):
    out = []
    for r in range(world):
        s = LengthGroupedSampler(lengths, batch, seed)
        s.world, s.rank = world, r
        s.global_batch = batch * world
        s.num_batches = -(-len(lengths) // s.global_batch)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n,batch,world", [(100, 4, 2), (37, 3, 2), (10, 4, 1), (5, 2, 4)])
def test_every_rank_same_count_and_every_row_seen(n, batch, world):
    lengths = [(i * 37) % 101 for i in range(n)]
    orders = rank_orders(lengths, batch, world)
    assert len({len(o) for o in orders}) == 1 and len(orders[0]) % batch == 0
    assert set().union(*map(set, orders)) == set(range(n))


def test_batches_group_similar_lengths_and_are_deterministic():
    lengths = list(range(400))
    a = rank_orders(lengths, 4, 2)
    assert a == rank_orders(lengths, 4, 2)  # same seed and epoch -> same order on every call
    assert a != rank_orders(lengths, 4, 2, epoch=1)
    # each global batch (4 rows per rank x 2 ranks) spans far less than a random batch would
    spans = [max(lengths[i] for i in a[0][k:k + 4] + a[1][k:k + 4]) - min(lengths[i] for i in a[0][k:k + 4] + a[1][k:k + 4])
             for k in range(0, len(a[0]), 4)]
    assert sum(spans) / len(spans) < 60  # a random batch of 8 of 0..399 spans ~310 on average
