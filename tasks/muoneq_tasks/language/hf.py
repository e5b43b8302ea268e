"""Any Hugging Face causal LM in the language task: ``task.model.arch=hf``.

The model is built with ``AutoModelForCausalLM.from_config`` — its architecture only, no
weights, initialized by the model's own ``_init_weights`` from the run's seed — from either

* a local ``config.json`` (``task.model.hf_config``: the file or its folder), e.g. a LLaMA-3,
  Qwen or Mistral configuration downloaded once; its sizes are used as they are; or
* a ``transformers`` model type (``task.model.hf_model_type``, e.g. ``qwen2``, ``mistral``,
  ``llama``) at one of the suite's named sizes (``task.model.size``: the paper's LLaMA
  dimensions, :data:`HF_SIZES`),

with ``task.model.hf_overrides`` (any config key of that model type) applied last. The
vocabulary is the shards' tokenizer's (padded like the suite's own models), so the special
token ids of the config (``bos``/``eos``/``pad``), which belong to another tokenizer, are
cleared; the weights are float32 (the trainer's ``precision`` sets the compute dtype).
FSDP2 shards the model's decoder layers (the classes its ``_no_split_modules`` names).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from muoneq_tasks.language.base import CausalLM
from muoneq_tasks.language.llama import LLAMA_SIZES

#: ``task.model.size`` for ``hf_model_type``: the paper's LLaMA dimensions as HF config keys.
HF_SIZES: dict[str, dict] = {
    name: {"hidden_size": s["width"], "intermediate_size": s["intermediate"],
           "num_hidden_layers": s["n_layer"], "num_attention_heads": s["n_head"],
           "num_key_value_heads": s["n_head"]}
    for name, s in LLAMA_SIZES.items()
}

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_path(path: str) -> Path:
    """The ``config.json`` that ``task.model.hf_config`` points at (the file or its folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"task.model.hf_config: no config.json at {path}; pass the path of a "
                         "Hugging Face config.json or of the folder holding it")
    return p


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def hf_config(*, config: str | None, model_type: str | None, size: str | None,
              overrides: dict, max_seq_len: int, vocab_size: int | None = None):
    """The ``transformers`` config of the run (errors name the ``task.model`` field; the
    task's config checks it when composed, with the config's own vocabulary)."""
    from transformers import AutoConfig

    if config is not None:
        values = json.loads(config_path(config).read_text())
        model_type = values.get("model_type")
        base = AutoConfig.for_model(model_type) if model_type in causal_lm_types() else None
        if base is None:
            raise ValueError(f"task.model.hf_config: {config} has model_type={model_type!r}, "
                             "not a causal LM of this transformers version")
        values.pop("model_type")
        keys = dict(values)
    else:
        if model_type not in causal_lm_types():
            close = difflib.get_close_matches(str(model_type), causal_lm_types(), n=3)
            raise ValueError(
                f"task.model.hf_model_type: {model_type!r} is not a causal-LM model type of "
                f"transformers{'; did you mean ' + ', '.join(close) + '?' if close else ''} "
                "(allowed: the keys of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, e.g. "
                "llama, qwen2, mistral, gemma, phi3)")
        base = AutoConfig.for_model(model_type)
        keys = dict(HF_SIZES[size])
    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    missing = [k for k in keys if config is None and k not in known]
    if missing:
        raise ValueError(
            f"task.model.size: the {model_type} config has no {missing[0]!r} (the suite's "
            "sizes are LLaMA-style); set its sizes with task.model.hf_overrides on a local "
            "config.json (task.model.hf_config)")
    unknown = sorted(set(overrides) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        raise ValueError(
            f"task.model.hf_overrides: {unknown[0]!r} is not a key of the {model_type} config"
            + (f"; did you mean {close[0]!r}?" if close else ""))
    keys.update(overrides)
    keys.update(dict.fromkeys(_TOKEN_IDS))
    if vocab_size is not None:
        keys["vocab_size"] = vocab_size
    cfg = AutoConfig.for_model(model_type, **keys)
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < max_seq_len:
        raise ValueError(
            f"task.data.seq_len={max_seq_len} exceeds the model's max_position_embeddings="
            f"{positions}; raise it with task.model.hf_overrides.max_position_embeddings or "
            "shorten task.data.seq_len")
    return cfg


class HFCausalLM(CausalLM):
    """A ``transformers`` causal LM as the language task's model: ``forward(idx) -> logits``."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.config = config
        self.n_layer = config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.width = heads * head_dim  # the attention width of the FLOP count
        units = set(getattr(self.hf, "_no_split_modules", None) or ())
        self._blocks = [m for m in self.hf.modules() if type(m).__name__ in units]
        if not self._blocks:
            raise ValueError(f"task.model: {type(self.hf).__name__} names no decoder-layer "
                             "class in _no_split_modules (FSDP2 could not shard it by layer)")

    @property
    def blocks(self) -> list[nn.Module]:
        """The decoder layers (what FSDP2 shards one by one)."""
        return self._blocks

    def forward(self, idx: Tensor) -> Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits
