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


def init_adamw_state(p: Tensor, state: dict, *, capturable: bool = False) -> None:
    """Two moments and a step counter, named as ``torch.optim.AdamW`` names them (the counter
    on the parameter's device when the step is ``capturable``, as torch keeps it)."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32,
                                 device=p.device if capturable else None)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float | Tensor,
    capturable: bool = False,
) -> None:
    """One AdamW step for a list of tensors (in place); ``states`` as :func:`init_adamw_state`.

    A complex tensor is updated as its real view (``torch.view_as_real``), as
    ``torch.optim.AdamW`` does: its real and imaginary parts are two real parameters.
    ``capturable``: the bias corrections are computed on the device from the step tensors
    (``lr`` and ``weight_decay`` may be tensors), as torch's capturable AdamW computes them, so
    that nothing is read back to the host.
    """
    if not params:
        return
    params, grads = _real_views(params), _real_views(grads)
    exp_avgs = _real_views([s["exp_avg"] for s in states])
    exp_avg_sqs = _real_views([s["exp_avg_sq"] for s in states])
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if capturable:
        _capturable_update(params, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps)
        return
    counts = [s.item() for s in steps]
    step_sizes = [-(lr / (1 - beta1**t)) for t in counts]
    bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in counts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def _capturable_update(params, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps) -> None:
    """``X ← X − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`` with ``t`` read on the device."""
    inverse_steps = torch._foreach_pow(beta1, steps)  # (β₁ᵗ − 1)/lr = −1/step size
    torch._foreach_sub_(inverse_steps, 1)
    torch._foreach_div_(inverse_steps, lr)
    corrections2 = torch._foreach_pow(beta2, steps)  # √(1 − β₂ᵗ)
    torch._foreach_neg_(corrections2)
    torch._foreach_add_(corrections2, 1)
    torch._foreach_sqrt_(corrections2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, corrections2)
    torch._foreach_add_(denom, eps)
    torch._foreach_mul_(denom, inverse_steps)
    torch._foreach_addcdiv_(params, exp_avgs, denom)


def _real_views(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
