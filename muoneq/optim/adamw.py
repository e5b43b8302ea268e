"""The AdamW fallback shared by every hybrid optimizer of the package.

Hidden matrices take the Muon-type path; embeddings, heads and 0-D/1-D tensors take this
update (the paper's routing, Appendix "Pretraining on C4"). It is the decoupled-weight-decay
Adam of Loshchilov & Hutter with bias correction, written with the same foreach operations
and in the same order as ``torch.optim.AdamW`` (``foreach=True``, non-capturable) so that the
two agree step for step; we keep it here because one optimizer object must serve the whole
model (Lightning's ``configure_optimizers`` and LR schedulers expect one).
"""

from __future__ import annotations

import torch
from torch import Tensor


def init_adamw_state(p: Tensor, state: dict) -> None:
    """Two moments and a step counter, named as ``torch.optim.AdamW`` names them."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step for a list of tensors (in place); ``states`` as :func:`init_adamw_state`.

    A complex tensor is updated as its real view (``torch.view_as_real``), as
    ``torch.optim.AdamW`` does: its real and imaginary parts are two real parameters.
    """
    if not params:
        return
    params, grads = _real_views(params), _real_views(grads)
    exp_avgs = _real_views([s["exp_avg"] for s in states])
    exp_avg_sqs = _real_views([s["exp_avg_sq"] for s in states])
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    counts = [s.item() for s in steps]
    step_sizes = [-(lr / (1 - beta1**t)) for t in counts]
    bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in counts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def _real_views(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
