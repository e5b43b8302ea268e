"""The typed config of the ``language`` task (``task.*``), apart from the task's modules so that
composing a config (``muoneq train --print-config``, a sweep's checks) never imports Lightning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muoneq_tasks.language.data import DEFAULT_VAL_TOKENS
from muoneq_tasks.language.hf import HF_SIZES, hf_config
from muoneq_tasks.language.models import ARCHITECTURES


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


#: ``task.model.arch`` values: the suite's own models, and ``hf`` (any transformers causal LM).
ARCHS = (*ARCHITECTURES, "hf")


@dataclass
class LanguageModelConfig:
    #: ``gpt2``, ``llama`` (the suite's models) or ``hf`` (a transformers causal LM, built from
    #: ``hf_config`` or ``hf_model_type``: see tasks/muoneq_tasks/language/hf.py).
    arch: str = "llama"
    #: gpt2: ``small``, ``tiny``; llama, and hf with ``hf_model_type``: ``tiny``, ``60m``,
    #: ``130m``, ``350m``, ``1b``; hf with ``hf_config``: null (the config.json sets the sizes).
    size: str | None = "130m"
    #: GPT-2 only: share the token embedding with the output head (GPT-2's choice, default).
    tie_embeddings: bool | None = None
    #: The tokenizer's vocabulary is padded up to a multiple of this (GPT-2: 50257 → 50304).
    vocab_multiple: int = 64
    #: arch=hf: a local Hugging Face ``config.json`` (or the folder holding it).
    hf_config: str | None = None
    #: arch=hf: a transformers model type (``llama``, ``qwen2``, ``mistral``…) at ``size``.
    hf_model_type: str | None = None
    #: arch=hf: config keys set last (e.g. ``num_key_value_heads: 4``, ``rope_theta: 5e5``).
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"task.model.arch: unknown {self.arch!r}; "
                             f"allowed: {', '.join(ARCHS)}")
        hf_keys = {"hf_config": self.hf_config, "hf_model_type": self.hf_model_type}
        if self.arch == "hf":
            self._check_hf(hf_keys)
        else:
            given = [k for k, v in hf_keys.items() if v is not None]
            if given or self.hf_overrides:
                key = given[0] if given else "hf_overrides"
                raise ValueError(f"task.model.{key}: only for arch=hf (got arch={self.arch})")
            sizes = ARCHITECTURES[self.arch][2]
            if self.size not in sizes:
                raise ValueError(f"task.model.size: unknown {self.size!r} for {self.arch}; "
                                 f"allowed: {', '.join(sizes)}")
        if self.tie_embeddings is not None and self.arch != "gpt2":
            raise ValueError("task.model.tie_embeddings: only for arch=gpt2 (LLaMA's head is "
                             "untied; arch=hf: task.model.hf_overrides.tie_word_embeddings); "
                             "leave it null")
        if self.vocab_multiple < 1:
            raise ValueError(f"task.model.vocab_multiple: must be ≥ 1, got {self.vocab_multiple}")

    def _check_hf(self, hf_keys: dict) -> None:
        if (self.hf_config is None) == (self.hf_model_type is None):
            raise ValueError(
                "task.model.hf_config / task.model.hf_model_type: arch=hf needs exactly one: a "
                "local config.json, or a transformers model type (with task.model.size)")
        if self.hf_config is not None and self.size is not None:
            raise ValueError(
                f"task.model.size: leave it null with task.model.hf_config (the config.json "
                f"sets the sizes; change them with task.model.hf_overrides), got {self.size!r}")
        if self.hf_model_type is not None and self.size not in HF_SIZES:
            raise ValueError(f"task.model.size: unknown {self.size!r} for arch=hf with "
                             f"hf_model_type; allowed: {', '.join(HF_SIZES)}")


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
        model = self.model
        if model.arch == "hf":  # the model type, the override keys and the positions
            hf_config(config=model.hf_config, model_type=model.hf_model_type, size=model.size,
                      overrides=dict(model.hf_overrides), max_seq_len=self.data.seq_len)
        if self.val_every_n_steps < 1:
            raise ValueError(f"task.val_every_n_steps: must be ≥ 1, got {self.val_every_n_steps}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"task.peak_tflops: must be > 0 or null, got {self.peak_tflops}")
