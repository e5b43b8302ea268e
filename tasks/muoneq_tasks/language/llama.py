"""LLaMA-2 (Touvron et al., 2023) in plain PyTorch: the paper's LLaMA2-130M/350M/1B/C4 models.

As the HF ``LlamaForCausalLM`` configs the paper's authors' code uses: pre-norm blocks
with RMSNorm (eps 1e-6), SwiGLU MLP ``down(silu(gate(x)) ⊙ up(x))``, rotary position
embeddings (θ = 10,000, rotate-half convention) on queries and keys, no biases, an untied
``lm_head``, every weight N(0, 0.02). Module names follow HF (``self_attn.q_proj``,
``mlp.gate_proj``…) so diagnostics can select query/key/value/output/gate/up/down by name.
The vocabulary follows the tokenizer (the paper used T5's 32,000; shards are GPT-2 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muoneq_tasks.language.base import CausalLM


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    n_layer: int = 12
    n_head: int = 12
    width: int = 768
    intermediate: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self):
        if self.width % self.n_head or (self.width // self.n_head) % 2:
            raise ValueError(
                f"width ({self.width}) must split into n_head ({self.n_head}) heads of even size"
            )


#: Named sizes (hidden / intermediate / layers / heads) of the paper and GaLore's LLaMA configs.
LLAMA_SIZES: dict[str, dict] = {
    "tiny": dict(width=64, intermediate=172, n_layer=2, n_head=4),
    "60m": dict(width=512, intermediate=1376, n_layer=8, n_head=8),
    "130m": dict(width=768, intermediate=2048, n_layer=12, n_head=12),
    "350m": dict(width=1024, intermediate=2736, n_layer=24, n_head=16),
    "1b": dict(width=2048, intermediate=5461, n_layer=24, n_head=32),
}


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``(T, head_dim)`` of the rotary embedding (RoFormer, eq. 34).

    Recomputed each forward (a T×head_dim outer product, negligible next to attention) so the
    model holds no buffers that a meta-device build would leave uninitialized.
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = theta**-exponents
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, H, T, hd)`` by the position angles (HF's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.o_proj = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, C = x.shape
        heads = (B, T, self.n_head, C // self.n_head)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (proj(x).view(heads).transpose(1, 2) for proj in projections)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """LLaMA-2: ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.n_layer, self.width = cfg.n_layer, cfg.width
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF LLaMA initialization: every Linear and Embedding N(0, init_std), norms to 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def forward(self, idx: Tensor) -> Tensor:
        cfg = self.config
        cos, sin = rotary_cos_sin(idx.shape[1], cfg.width // cfg.n_head, cfg.rope_theta, idx.device)
        x = self.embed_tokens(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))
