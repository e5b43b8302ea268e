"""ResumableSampler: seeded order, disjoint rank shards, mid-epoch skip."""

from __future__ import annotations

import pytest

from muoneq.suite.runtime import ResumableSampler


@pytest.mark.parametrize(("size", "world"), [(12, 3), (10, 4), (7, 1)])
def test_ranks_partition_the_epoch(size, world):
    shards = [list(ResumableSampler(size, seed=5, num_replicas=world, rank=r))
              for r in range(world)]
    per_rank = -(-size // world)
    assert all(len(s) == per_rank for s in shards)
    everything = [i for s in shards for i in s]
    assert sorted(set(everything)) == list(range(size))  # every sample seen
    assert len(everything) - size == per_rank * world - size  # only the wrap-around padding repeats
    if size % world == 0:
        assert len(set(everything)) == size  # disjoint


def test_order_is_a_function_of_seed_and_epoch():
    a = ResumableSampler(50, seed=1)
    first = list(a)
    assert list(a) == first  # re-iterating the same epoch repeats it
    a.set_epoch(1)
    second = list(a)
    assert second != first and sorted(second) == list(range(50))
    assert list(ResumableSampler(50, seed=1, epoch=1)) == second
    assert list(ResumableSampler(50, seed=2)) != first
    assert list(ResumableSampler(50, seed=1, shuffle=False)) == list(range(50))


def test_skip_applies_to_the_resumed_epoch_only():
    full = list(ResumableSampler(40, seed=0, num_replicas=2, rank=1, epoch=3))
    resumed = ResumableSampler(40, seed=0, num_replicas=2, rank=1, epoch=3, skip=6)
    assert list(resumed) == full[6:]
    assert len(resumed) == len(full)  # Lightning counts the resumed epoch from the saved batch
    resumed.set_epoch(4)
    assert list(resumed) == list(ResumableSampler(40, seed=0, num_replicas=2, rank=1, epoch=4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank 2 outside"):
        ResumableSampler(10, seed=0, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="size must be"):
        ResumableSampler(0, seed=0)
