"""GPT-2 (Radford et al., 2019) in plain PyTorch: the paper's GPT2-small/FineWeb ablation model.

Pre-norm blocks with LayerNorm, GELU (tanh) MLP of width 4d, learned absolute positions,
biases, causal attention through ``F.scaled_dot_product_attention`` (flash attention on GPU).
Initialization as GPT-2/nanoGPT: N(0, 0.02), residual output projections N(0, 0.02/√(2L)).

Head: **tied** to the token embedding by default (``tie_embeddings=True``), as GPT-2 and
nanoGPT do; GPT2-small then has 124.5M parameters at 1,024 positions. ``tie_embeddings=False``
adds a separate ``lm_head`` (+38.6M). Either way the head is routed to AdamW by
:func:`muoneq.param_groups` (the tied one through its embedding, the untied one by its name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muoneq_tasks.language.base import CausalLM


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    max_seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    width: int = 768
    bias: bool = True
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.width % self.n_head:
            raise ValueError(f"width ({self.width}) must be divisible by n_head ({self.n_head})")


#: Named sizes: ``small`` is GPT-2 small; ``tiny`` is for tests and CPU smoke runs.
GPT_SIZES: dict[str, dict] = {
    "small": dict(n_layer=12, n_head=12, width=768),
    "tiny": dict(n_layer=2, n_head=2, width=64),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    """GPT-2: ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.n_layer, self.width = cfg.n_layer, cfg.width
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialization (also used after materializing a meta-device model)."""
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's max_seq_len={self.config.max_seq_len}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
