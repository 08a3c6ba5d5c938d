"""The length-grouped distributed sampler: same rows on every rank count, full coverage, determinism."""

import pytest

from rlhfkit.loaders import LengthGroupedSampler


def rank_orders(lengths, batch, world, seed=7, epoch=0):
    out = []
    for r in range(world):
        s = LengthGroupedSampler(lengths, batch, seed, world=world, rank=r)
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


def test_each_rank_takes_its_slice_of_every_global_batch():
    """A global batch is a run of one length-sorted mega-batch (longest first); rank r takes rows
    [r * batch, (r + 1) * batch) of it, so rank 0's k-th batch and rank 1's k-th batch together are
    sorted longest first."""
    lengths = [(i * 37) % 101 for i in range(48)]
    a = rank_orders(lengths, 3, 2)
    for k in range(0, len(a[0]), 3):
        together = [lengths[i] for i in a[0][k:k + 3] + a[1][k:k + 3]]
        assert together == sorted(together, reverse=True)


def test_a_rank_outside_the_world_is_an_error():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        LengthGroupedSampler([1, 2, 3], 1, 0, world=2, rank=2)
