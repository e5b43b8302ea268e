"""What every language model of the suite exposes: parameter counts and model FLOPs per token."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def lm_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy (nats) of logits ``(B, T, V)`` against targets ``(B, T)``,
    computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round ``vocab_size`` up to a multiple of ``multiple`` (GPT-2's 50257 → 50304 for 64).

    Padding only adds rows to the embedding and the head (tensor-core friendly shapes); the
    padded ids never occur in the data, so their logits are pushed down by the softmax.
    """
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size and multiple must be ≥ 1, got {vocab_size} and {multiple}")
    return -(-vocab_size // multiple) * multiple


class CausalLM(nn.Module):
    """Base class: ``forward(idx) -> logits``, plus the accounting used for MFU.

    Subclasses set ``self.blocks`` (an ``nn.ModuleList`` of transformer blocks: the units that
    FSDP2 shards one by one), ``self.n_layer`` and ``self.width`` (the attention width).
    """

    blocks: nn.ModuleList
    n_layer: int
    width: int

    def embedding_modules(self) -> list[nn.Embedding]:
        return [m for m in self.modules() if isinstance(m, nn.Embedding)]

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied head counted once); ``non_embedding`` drops the lookups.

        With a tied head the shared matrix is an embedding *and* the head: it is kept in the
        non-embedding count because it does the head's matmul.
        """
        params = {id(p): p for p in self.parameters()}
        if non_embedding:
            matmul = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
            for module in self.embedding_modules():
                if id(module.weight) not in matmul:
                    params.pop(id(module.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs per trained token (forward + backward), PaLM's convention (App. B).

        ``6·N + 12·L·d·T``: ``N`` the non-embedding parameters (every matmul, the head
        included), ``L`` layers, ``d`` the attention width, ``T`` the sequence length; the
        attention term counts the full T×T score matrix even though it is causal, as PaLM,
        nanoGPT and torchtitan do, so MFU figures are comparable with theirs.
        """
        return 6 * self.num_params(non_embedding=True) + 12 * self.n_layer * self.width * seq_len
