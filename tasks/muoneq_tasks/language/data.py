"""Training and validation sequences read from memory-mapped token shards.

* :class:`TokenStream`: the shards of one split as one long token sequence (memory-mapped;
  nothing is loaded until a sequence is read).
* :class:`PackedSequences`: sequence ``i`` is the tokens ``[i·T, i·T + T]`` (inputs the first
  ``T``, targets shifted by one), so every token of the stream is predicted exactly once,
  documents packed back to back with their ``<|endoftext|>`` separators.
* :class:`SequenceSampler`: a deterministic order from ``(seed, epoch)``, each rank a disjoint
  slice, started mid-epoch on the next unseen batch when a run resumes (the data module
  passes the position it saved in the checkpoint).
* :func:`validation_sequences` + :class:`ShardedEvalSampler`: the first ``budget`` predicted
  tokens of the validation split (default 10,485,760), identical for every optimizer, split
  over ranks without padding, so the mean loss is over exactly ``budget`` tokens.
* :func:`check_split_sizes`: the same checks of the splits' sizes, from the shards' headers
  alone, before any run starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from muoneq.suite.errors import UserError
from muoneq_tasks.language.shards import find_shards, open_shard, read_header

DEFAULT_VAL_TOKENS = 10_485_760


class SplitTooSmall(UserError, ValueError):
    """A split holds fewer tokens than a run reads from it (the message names the split, both
    sizes and the fix): a data error, which no retry can mend."""


class TokenStream:
    """The concatenated tokens of ``files`` (validated up front, memory-mapped on first read).

    The memory maps are opened lazily in each process, and left out of pickles, so that
    DataLoader workers map the files themselves instead of receiving copies of them.
    """

    def __init__(self, files: Sequence[str | Path]):
        if not files:
            raise ValueError("TokenStream needs at least one shard file")
        self.files = [Path(f) for f in files]
        sizes = [read_header(f) for f in self.files]
        self.offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as int64 (crossing shard boundaries if needed)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside the stream of {len(self)} tokens")
        if self._maps is None:
            self._maps = [open_shard(f) for f in self.files]
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        shard = first
        while start < stop:
            lo = start - int(self.offsets[shard])
            hi = min(stop, int(self.offsets[shard + 1])) - int(self.offsets[shard])
            pieces.append(self._maps[shard][lo:hi])
            start += hi - lo
            shard += 1
        out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return out.astype(np.int64)


class PackedSequences(Dataset):
    """Sequence ``i`` = ``(tokens[i·T : i·T+T], tokens[i·T+1 : i·T+T+1])`` of the stream.

    ``limit`` uses only the first ``limit`` tokens of the stream.
    """

    def __init__(self, stream: TokenStream, seq_len: int, limit: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
        self.stream = stream
        self.seq_len = seq_len
        available = len(stream) if limit is None else min(limit, len(stream))
        self.n = max(0, (available - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(f"sequence {index} out of range [0, {self.n})")
        start = index * self.seq_len
        tokens = torch.from_numpy(self.stream.read(start, start + self.seq_len + 1))
        return tokens[:-1], tokens[1:]


# SequenceSampler and ShardedEvalSampler subclass DistributedSampler because they *are*
# distributed samplers: Lightning leaves such samplers in place, where it would otherwise wrap
# them in its own (padding, reshuffling) distributed sampler.


class SequenceSampler(DistributedSampler):
    """Deterministic, distributed, resumable order of ``n`` sequences in whole batches.

    Epoch ``e`` draws a permutation from ``(seed, e)`` (or keeps the natural order with
    ``shuffle=False``); global position ``j`` goes to rank ``j mod world_size``, so ranks see
    disjoint sequences; every rank gets the same number of full batches of ``batch_size``
    (the remainder of the epoch is dropped). ``epoch`` and ``consumed`` (the samples this rank
    had handed to training in that epoch) set the starting position of a run resumed from a
    checkpoint: iteration starts after them, and after a complete epoch the next one begins.
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, epoch: int = 0, consumed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank, self.num_replicas, self.drop_last = rank, world_size, True
        self.batches_per_epoch = n // world_size // batch_size
        if self.batches_per_epoch == 0:
            raise SplitTooSmall(
                f"the training split holds {n} sequences, which cannot fill one batch of "
                f"{batch_size} on each of {world_size} process(es); prepare more training "
                "tokens, or lower task.data.micro_batch_size or task.data.seq_len"
            )
        self.epoch, self.consumed = epoch, consumed

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The global order of epoch ``epoch`` (before the split over ranks)."""
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __iter__(self) -> Iterator[int]:
        if self.consumed >= len(self):
            self.epoch, self.consumed = self.epoch + 1, 0
        mine = self.order(self.epoch)[self.rank::self.num_replicas][: len(self)]
        return iter(mine[self.consumed:].tolist())

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start; a no-op for the epoch already under way."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0


class ShardedEvalSampler(DistributedSampler):
    """Rank ``r`` of ``w`` takes rows ``r, r+w, r+2w, …``: every row once, none padded."""

    def __init__(self, n: int, *, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.n, self.rank, self.num_replicas = n, rank, world_size
        self.shuffle, self.drop_last, self.seed, self.epoch = False, False, 0, 0

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.num_replicas))


def validation_sequences(stream: TokenStream, seq_len: int,
                         budget: int = DEFAULT_VAL_TOKENS) -> PackedSequences:
    """The validation set: the first ``budget`` predicted tokens of the validation stream, as
    ``budget / seq_len`` rows (targets are tokens ``1 … budget``, so ``budget + 1`` are read)."""
    if budget < 1 or budget % seq_len:
        raise ValueError(
            f"data.val_tokens={budget} must be a positive multiple of the sequence length "
            f"{seq_len} so that the validation set is exactly that many tokens"
        )
    if len(stream) < budget + 1:
        files = stream.files
        where = str(files[0]) if len(files) == 1 else f"{len(files)} shards in {files[0].parent}"
        fits = (len(stream) - 1) // seq_len * seq_len
        raise SplitTooSmall(
            f"task.data.val_tokens={budget} needs {budget + 1} tokens of the validation split, "
            f"which has {len(stream)} ({where}); "
            + (f"lower task.data.val_tokens to {fits} or less, or " if fits else "")
            + "prepare a larger validation split (muoneq data … --val-tokens N)"
        )
    return PackedSequences(stream, seq_len, limit=budget + 1)


def perplexity(mean_loss: float) -> float:
    """``exp(mean token cross-entropy)`` (nats), the paper's validation perplexity."""
    return math.exp(mean_loss)


def check_split_sizes(data) -> None:
    """Raise what a run on the shards of ``data`` (a ``task.data`` config) would raise about
    them before its first step, from their headers alone (a sweep's preflight): a missing split
    (:class:`~muoneq.suite.errors.DataError`), a damaged shard, a validation split shorter than
    ``val_tokens + 1`` or a training split shorter than one micro-batch
    (:class:`SplitTooSmall`; more processes need more)."""
    train = TokenStream(find_shards(data.train_files or data.dir, "train"))
    val = TokenStream(find_shards(data.val_files or data.dir, "val"))
    validation_sequences(val, data.seq_len, data.val_tokens)
    SequenceSampler(len(PackedSequences(train, data.seq_len)), data.micro_batch_size)
