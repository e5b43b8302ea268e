"""The ``language`` task: GPT-2 or LLaMA-2 pretraining on token shards, validation perplexity.

Recipes of the paper: ``conf/experiment/gpt2_small_fineweb.yaml`` (ablation table) and
``llama{130m,350m,1b}_c4.yaml`` (main comparison), ``llama_tiny_shakespeare.yaml`` for a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from muoneq.runtime import TaskSpec
from muoneq.tasks.language.base import pad_vocab
from muoneq.tasks.language.datamodule import (
    LanguageDataConfig,
    LanguageDataModule,
    shard_vocab_size,
)
from muoneq.tasks.language.models import ARCHITECTURES, build_model
from muoneq.tasks.language.module import LanguageModule


@dataclass
class LanguageModelConfig:
    #: ``gpt2`` or ``llama``.
    arch: str = "llama"
    #: gpt2: ``small``, ``tiny``; llama: ``tiny``, ``60m``, ``130m``, ``350m``, ``1b``.
    size: str = "130m"
    #: GPT-2 only: share the token embedding with the output head (GPT-2's choice, default).
    tie_embeddings: bool | None = None
    #: The tokenizer's vocabulary is padded up to a multiple of this (GPT-2: 50257 → 50304).
    vocab_multiple: int = 64

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"task.model.arch: unknown {self.arch!r}; "
                             f"allowed: {', '.join(ARCHITECTURES)}")
        sizes = ARCHITECTURES[self.arch][2]
        if self.size not in sizes:
            raise ValueError(f"task.model.size: unknown {self.size!r} for {self.arch}; "
                             f"allowed: {', '.join(sizes)}")
        if self.tie_embeddings is not None and self.arch != "gpt2":
            raise ValueError("task.model.tie_embeddings: only for arch=gpt2 (LLaMA's head is "
                             "untied); leave it null")
        if self.vocab_multiple < 1:
            raise ValueError(f"task.model.vocab_multiple: must be ≥ 1, got {self.vocab_multiple}")


@dataclass
class LanguageTaskConfig:
    name: str = "language"
    model: LanguageModelConfig = field(default_factory=LanguageModelConfig)
    data: LanguageDataConfig = field(default_factory=LanguageDataConfig)
    #: Validate every this many optimizer steps (and at the end of training).
    val_every_n_steps: int = 1000
    #: Peak TFLOP/s of one device for MFU; ``None``: known NVIDIA GPUs are recognized by name.
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.val_every_n_steps < 1:
            raise ValueError(f"task.val_every_n_steps: must be ≥ 1, got {self.val_every_n_steps}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"task.peak_tflops: must be > 0 or null, got {self.peak_tflops}")


def build(cfg) -> tuple[LanguageModule, LanguageDataModule]:
    """The model (initialized from ``cfg.seed`` alone: every optimizer of a seed starts from the
    same weights), its module and the data module."""
    task: LanguageTaskConfig = OmegaConf.to_object(cfg.task)
    vocab = pad_vocab(shard_vocab_size(task.data), task.model.vocab_multiple)
    tie = task.model.tie_embeddings
    extra = {} if tie is None else {"tie_embeddings": tie}
    torch.manual_seed(cfg.seed)
    model = build_model(task.model.arch, task.model.size, vocab_size=vocab,
                        max_seq_len=task.data.seq_len, **extra)
    module = LanguageModule(
        model, seq_len=task.data.seq_len, batch_size=task.data.batch_size,
        micro_batch_size=task.data.micro_batch_size, val_every_n_steps=task.val_every_n_steps,
        peak_tflops=task.peak_tflops, optimizer=cfg.optimizer, schedule=cfg.schedule,
        compile=cfg.trainer.compile,
    )
    return module, LanguageDataModule(task.data, seed=cfg.seed)


TASK = TaskSpec(LanguageTaskConfig, build, "GPT-2 / LLaMA-2 pretraining on token shards: "
                "validation perplexity")
