"""The language task's data: packed training sequences and the fixed validation set, from shards.

``task.data.dir`` is a folder of llm.c / modded-nanogpt shards (``*_train_*.bin`` and
``*_val_*.bin``, as written by ``muoneq data`` or downloaded pre-tokenized);
``task.data.train_files`` / ``val_files`` (glob patterns) override where each split is found.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from muoneq.suite.runtime import ConfigError, TaskDataModule
from muoneq_tasks.language.config import LanguageDataConfig
from muoneq_tasks.language.data import (
    PackedSequences,
    SequenceSampler,
    ShardedEvalSampler,
    TokenStream,
    validation_sequences,
)
from muoneq_tasks.language.prepare import PROGRESS_FILE
from muoneq_tasks.language.shards import check_vocabulary, find_shards
from muoneq_tasks.language.tokenizer import load_tokenizer


def shard_vocab_size(cfg: LanguageDataConfig) -> int:
    """The tokenizer's vocabulary size for the shards of ``cfg`` (before padding)."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    info = Path(cfg.dir).expanduser() / PROGRESS_FILE
    if info.is_file():
        prepared = json.loads(info.read_text())["settings"]
        if prepared["tokenizer"] != cfg.tokenizer:
            raise ConfigError(
                f"task.data.tokenizer={cfg.tokenizer} does not match the shards in {cfg.dir}: "
                f"their {PROGRESS_FILE} says they were written with {prepared['tokenizer']}; "
                f"pass task.data.tokenizer={prepared['tokenizer']}, or write the shards again "
                f"with `muoneq data ... --tokenizer {cfg.tokenizer}`"
            )
        return prepared["vocab_size"]
    return load_tokenizer(cfg.tokenizer).n_vocab


class LanguageDataModule(TaskDataModule):
    """Training: :class:`PackedSequences` in the order of a :class:`SequenceSampler` (each
    process a disjoint slice; a resumed run continues at the saved batch). Validation: the
    first ``val_tokens`` predicted tokens of the validation split, rows shared out without
    padding."""

    def __init__(self, cfg: LanguageDataConfig, *, seed: int, vocab_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.vocab_size = vocab_size  #: the tokenizer's; shards are checked against it
        self.train_set: PackedSequences | None = None
        self.val_set: PackedSequences | None = None

    def data_identity(self) -> dict:
        """The shard set: each split's shard names and sizes, and the SHA-256 of the folder's
        ``prepare.json`` (what ``muoneq data`` recorded writing them; None without one)."""
        cfg = self.cfg
        info = Path(cfg.dir).expanduser() / PROGRESS_FILE
        return {
            **{split: [[p.name, p.stat().st_size] for p in find_shards(files or cfg.dir, split)]
               for split, files in (("train", cfg.train_files), ("val", cfg.val_files))},
            PROGRESS_FILE: hashlib.sha256(info.read_bytes()).hexdigest() if info.is_file()
            else None,
        }

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        cfg = self.cfg
        train = find_shards(cfg.train_files or cfg.dir, "train")
        val = find_shards(cfg.val_files or cfg.dir, "val")
        if self.vocab_size is not None:
            check_vocabulary([*train, *val], self.vocab_size, cfg.tokenizer)
        self.train_set = PackedSequences(TokenStream(train), cfg.seq_len)
        self.val_set = validation_sequences(TokenStream(val), cfg.seq_len, cfg.val_tokens)

    def _loader(self, dataset, batch_size: int, sampler) -> DataLoader:
        workers = self.cfg.num_workers
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
            num_workers=workers, persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(), worker_init_fn=self.worker_init_fn(),
        )

    def train_dataloader(self) -> DataLoader:
        epoch, skip_batches = self.resume_position()
        micro = self.cfg.micro_batch_size
        sampler = SequenceSampler(
            len(self.train_set), micro, seed=self.seed, shuffle=self.cfg.shuffle,
            rank=self.rank, world_size=self.world_size, epoch=epoch, consumed=skip_batches * micro,
        )
        return self._loader(self.train_set, micro, sampler)

    def val_dataloader(self) -> DataLoader:
        sampler = ShardedEvalSampler(len(self.val_set), rank=self.rank, world_size=self.world_size)
        batch = self.cfg.val_micro_batch_size or self.cfg.micro_batch_size
        return self._loader(self.val_set, batch, sampler)
