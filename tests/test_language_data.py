"""Packed sequences from shards: coverage, deterministic order, resume, ranks, validation budget."""

import os
from itertools import islice

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from muoneq_tasks.language.data import (
    PackedSequences,
    SequenceSampler,
    ShardedEvalSampler,
    SplitTooSmall,
    TokenStream,
    validation_sequences,
)
from muoneq_tasks.language.shards import write_shard
from tests.helpers.ports import free_port


@pytest.fixture
def stream(tmp_path):
    """Three shards of uneven size holding 0, 1, 2, … (mod 65536): a token's value is its index."""
    tokens = np.arange(5003) % 65536
    bounds = [0, 1200, 1201, 5003]  # including a one-token shard
    files = [write_shard(tmp_path / f"d_train_{i:06d}.bin", tokens[a:b])
             for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    return TokenStream(files)


def test_stream_reads_across_shards(stream):
    assert len(stream) == 5003
    np.testing.assert_array_equal(stream.read(1190, 1210), np.arange(1190, 1210))
    np.testing.assert_array_equal(stream.read(0, 5003), np.arange(5003))
    with pytest.raises(IndexError):
        stream.read(5000, 5004)


def test_packed_sequences_cover_every_token_once(stream):
    ds = PackedSequences(stream, seq_len=64)
    assert len(ds) == (5003 - 1) // 64
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.dtype == torch.int64 and xs[0].shape == (64,)
    torch.testing.assert_close(x, torch.arange(len(ds) * 64))
    torch.testing.assert_close(y, x + 1)  # targets are the next tokens


def batches(loader, k=None):
    """The inputs of the first ``k`` batches (all with None), fetching no batch beyond them."""
    return [x for x, _ in islice(loader, k)]


def loader_of(ds, sampler: SequenceSampler, workers: int) -> DataLoader:
    """The training loader as the language data module builds it."""
    return DataLoader(ds, batch_size=sampler.batch_size, sampler=sampler, num_workers=workers)


def two_epochs(loader: DataLoader, k: int | None = None) -> list:
    """The rest of the loader's epoch, then the next one (Lightning calls ``set_epoch``)."""
    first = batches(loader, k)
    loader.sampler.set_epoch(loader.sampler.epoch + 1)
    return first + batches(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_same_batches(stream, workers):
    ds = PackedSequences(stream, seq_len=16)
    full = two_epochs(loader_of(ds, SequenceSampler(len(ds), 4, seed=7), workers))
    assert len(full) == 2 * (len(ds) // 4)

    head = batches(loader_of(ds, SequenceSampler(len(ds), 4, seed=7), workers), k=11)
    # a run resumed after 11 batches: the data module passes the saved position
    restarted = SequenceSampler(len(ds), 4, seed=7, epoch=0, consumed=11 * 4)
    resumed = head + two_epochs(loader_of(ds, restarted, workers))
    assert len(resumed) == len(full)  # the first epoch's rest, then the second epoch
    for a, b in zip(full, resumed, strict=True):
        torch.testing.assert_close(a, b)


def test_order_is_deterministic_and_changes_per_epoch(stream):
    ds = PackedSequences(stream, seq_len=16)
    a = SequenceSampler(len(ds), 4, seed=1)
    b = SequenceSampler(len(ds), 4, seed=1)
    e0 = list(a)
    assert e0 == list(b) and sorted(e0) != e0
    b.set_epoch(1)
    assert list(b) != e0 and sorted(list(b)) == sorted(e0)
    assert list(SequenceSampler(len(ds), 4, seed=2)) != e0
    assert list(SequenceSampler(len(ds), 4, shuffle=False)) == list(range(len(a)))


def test_too_few_sequences_for_one_batch_per_rank_is_an_error():
    with pytest.raises(ValueError, match="cannot fill one batch"):
        SequenceSampler(7, 4, world_size=2)


def test_ranks_see_disjoint_slices():
    samplers = [SequenceSampler(103, 5, seed=3, rank=r, world_size=3) for r in range(3)]
    parts = [list(s) for s in samplers]
    assert all(len(p) == 103 // 3 // 5 * 5 for p in parts)
    assert not set(parts[0]) & set(parts[1]) and not set(parts[1]) & set(parts[2])
    assert not set(parts[0]) & set(parts[2])
    # together they are the global order, rank r taking position j when j ≡ r (mod 3)
    order = samplers[0].order(0)
    for r, p in enumerate(parts):
        assert p == order[r::3][: len(p)].tolist()


def _ddp_worker(rank, world, port, files, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = PackedSequences(TokenStream(files), seq_len=8)
    loader = loader_of(ds, SequenceSampler(len(ds), 4, seed=5, rank=dist.get_rank(),
                                           world_size=dist.get_world_size()), workers=0)
    mine = torch.cat([x[:, 0] // 8 for x, _ in loader])  # sequence index from its first token
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        queue.put([g.tolist() for g in gathered])
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_ddp_sees_disjoint_data(stream):
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_ddp_worker, args=(2, port, stream.files, queue), nprocs=2,
                       start_method="spawn")
    rank0, rank1 = queue.get()
    n = (len(stream) - 1) // 8
    assert len(rank0) == len(rank1) == n // 2 // 4 * 4
    assert not set(rank0) & set(rank1)
    assert set(rank0) | set(rank1) <= set(range(n))


@pytest.mark.parametrize("world", [1, 3])
def test_validation_budget_is_exact(stream, world):
    budget, T = 64 * 20, 64
    val = validation_sequences(stream, T, budget)
    targets = []
    for rank in range(world):
        for i in ShardedEvalSampler(len(val), rank=rank, world_size=world):
            targets.append(val[i][1])
    targets = torch.sort(torch.cat(targets)).values
    # exactly the first `budget` predicted tokens (tokens 1 … budget), each once, on any world
    torch.testing.assert_close(targets, torch.arange(1, budget + 1))


def test_validation_errors(stream):
    with pytest.raises(ValueError, match="multiple of the sequence length 64"):
        validation_sequences(stream, 64, 1000)
    with pytest.raises(SplitTooSmall) as err:  # a UserError: one line, exit 2
        validation_sequences(stream, 64, 5120)
    assert str(err.value).startswith(
        "task.data.val_tokens=5120 needs 5121 tokens of the validation split, which has 5003 (")
    assert "lower task.data.val_tokens to 4992 or less, or prepare" in str(err.value)
