"""Build a language model by architecture and size name: ``build_model("llama", "130m", ...)``."""

from __future__ import annotations

import dataclasses

from muoneq_tasks.language.base import CausalLM
from muoneq_tasks.language.gpt import GPT, GPT_SIZES, GPTConfig
from muoneq_tasks.language.hf import HFCausalLM, hf_config
from muoneq_tasks.language.llama import LLAMA_SIZES, Llama, LlamaConfig

#: architecture → (model class, config class, named sizes)
ARCHITECTURES = {
    "gpt2": (GPT, GPTConfig, GPT_SIZES),
    "llama": (Llama, LlamaConfig, LLAMA_SIZES),
}


def model_config(arch: str, size: str, *, vocab_size: int, max_seq_len: int, **overrides):
    """The config of ``arch``/``size`` with the given vocabulary and any field overridden.

    ``max_seq_len`` sets GPT-2's learned position table (LLaMA's rotary embeddings need none).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"model.arch: unknown {arch!r}; allowed: {', '.join(ARCHITECTURES)}")
    _, config_cls, sizes = ARCHITECTURES[arch]
    if size not in sizes:
        raise ValueError(f"model.size: unknown {size!r} for {arch}; allowed: {', '.join(sizes)}")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(
            f"model: unknown field(s) {sorted(unknown)} for {arch}; allowed: {sorted(fields)}"
        )
    values = {**sizes[size], **overrides, "vocab_size": vocab_size}
    if "max_seq_len" in fields:
        values["max_seq_len"] = max_seq_len
    return config_cls(**values)


def build_model(
    arch: str, size: str | None, *, vocab_size: int, max_seq_len: int, **overrides
) -> CausalLM:
    """Instantiate the model (on the current default device: use ``torch.device("meta")`` to
    count parameters without allocating, then ``to_empty`` + ``reset_parameters``).

    ``arch="hf"``: a transformers causal LM; ``overrides`` are then :func:`hf_config`'s
    ``config``, ``model_type`` and ``overrides`` (tasks/muoneq_tasks/language/hf.py)."""
    if arch == "hf":
        return HFCausalLM(hf_config(size=size, vocab_size=vocab_size, max_seq_len=max_seq_len,
                                    **overrides))
    config = model_config(arch, size, vocab_size=vocab_size, max_seq_len=max_seq_len, **overrides)
    return ARCHITECTURES[arch][0](config)
