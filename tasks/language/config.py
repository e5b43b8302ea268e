"""The typed config of the ``language`` task (``task.*``), apart from the task's modules so that
composing a config (``muoneq train --print-config``, a sweep's checks) never imports Lightning."""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.language.data import DEFAULT_VAL_TOKENS
from tasks.language.models import ARCHITECTURES


@dataclass
class LanguageDataConfig:
    #: Folder of token shards (``*_train_NNNNNN.bin``, ``*_val_NNNNNN.bin``).
    dir: str = "data/c4"
    #: Glob patterns overriding where the splits are found (e.g. ``/data/fw/fineweb_train_*.bin``).
    train_files: str | None = None
    val_files: str | None = None
    #: The tokenizer the shards were written with (tiktoken name, ``.tiktoken`` file or ``byte``);
    #: it sets the vocabulary. Checked against ``prepare.json`` when the folder has one.
    tokenizer: str = "gpt2"
    #: Vocabulary of the shards' tokenizer, to skip loading the tokenizer (offline clusters with
    #: pre-tokenized shards). ``None``: from ``prepare.json``, else from the tokenizer.
    vocab_size: int | None = None
    #: Tokens per training sequence (the paper's tables: 4096).
    seq_len: int = 4096
    #: Global batch in sequences per optimizer step, reached with micro-batches and gradient
    #: accumulation: ``batch_size = micro_batch_size × accumulation × processes``.
    batch_size: int = 128
    #: Sequences per process per forward pass (lower it when memory runs out).
    micro_batch_size: int = 8
    #: Validation: the first ``val_tokens`` predicted tokens of the validation split, a multiple
    #: of ``seq_len`` (default 10,485,760 = 2,560 × 4,096, as modded-nanogpt).
    val_tokens: int = DEFAULT_VAL_TOKENS
    #: Sequences per process per validation forward; ``None``: ``micro_batch_size``.
    val_micro_batch_size: int | None = None
    shuffle: bool = True
    num_workers: int = 2

    def __post_init__(self) -> None:
        for key in ("seq_len", "batch_size", "micro_batch_size", "val_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.data.{key}: must be ≥ 1, got {getattr(self, key)}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"task.data.batch_size={self.batch_size} must be a multiple of "
                f"task.data.micro_batch_size={self.micro_batch_size}"
            )
        if self.val_tokens % self.seq_len:
            raise ValueError(
                f"task.data.val_tokens={self.val_tokens} must be a multiple of "
                f"task.data.seq_len={self.seq_len} (the validation set is exactly that many tokens)"
            )
        if self.num_workers < 0:
            raise ValueError(f"task.data.num_workers: must be ≥ 0, got {self.num_workers}")


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
