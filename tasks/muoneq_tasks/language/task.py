"""The ``language`` task: GPT-2, LLaMA-2 or any Hugging Face causal LM (``task.model.arch=hf``)
pretrained on token shards, validation perplexity.

Recipes of the paper: ``conf/experiment/gpt2_small_fineweb.yaml`` (ablation table) and
``llama{130m,350m,1b}_c4.yaml`` (main comparison), ``llama_tiny_shakespeare.yaml`` for a CPU.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from muoneq_tasks.language.base import pad_vocab
from muoneq_tasks.language.config import LanguageTaskConfig
from muoneq_tasks.language.datamodule import (
    LanguageDataModule,
    shard_vocab_size,
)
from muoneq_tasks.language.models import build_model
from muoneq_tasks.language.module import LanguageModule


def build(cfg) -> tuple[LanguageModule, LanguageDataModule]:
    """The model (initialized from ``cfg.seed`` alone: every optimizer of a seed starts from the
    same weights), its module and the data module."""
    task: LanguageTaskConfig = OmegaConf.to_object(cfg.task)
    tokens = shard_vocab_size(task.data)
    vocab = pad_vocab(tokens, task.model.vocab_multiple)
    tie = task.model.tie_embeddings
    extra = {} if tie is None else {"tie_embeddings": tie}
    if task.model.arch == "hf":
        extra = {"config": task.model.hf_config, "model_type": task.model.hf_model_type,
                 "overrides": dict(task.model.hf_overrides)}
    torch.manual_seed(cfg.seed)
    model = build_model(task.model.arch, task.model.size, vocab_size=vocab,
                        max_seq_len=task.data.seq_len, **extra)
    module = LanguageModule(
        model, seq_len=task.data.seq_len, batch_size=task.data.batch_size,
        micro_batch_size=task.data.micro_batch_size, val_every_n_steps=task.val_every_n_steps,
        peak_tflops=task.peak_tflops, optimizer=cfg.optimizer, schedule=cfg.schedule,
        compile=cfg.trainer.compile,
    )
    return module, LanguageDataModule(task.data, seed=cfg.seed, vocab_size=tokens)
