"""AdaMuon (Si et al., 2025): element-wise second moment on the orthogonalized update."""

from __future__ import annotations

import math
from typing import Unpack

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.newton_schulz import Request
from muoneq.optim.base import Hyper
from muoneq.optim.checks import boolean, decay, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared
from muoneq.optim.plan import Banked, Segment


class AdaMuon(HybridOrthogonalOptimizer):
    r"""AdaMuon: "Adaptive Muon Optimizer" (Si, Zhang, Shen, 2025, arXiv:2507.11005;
    official code Chongjie-Si/AdaMuon).

    For a matrix parameter ``X`` (m×n; conv filters as ``(out, in·kh·kw)``) with gradient ``G``,
    at step ``t``::

        M ← βM + (1−β)G;          M̃ = βM + (1−β)G (nesterov) or M
        O = NS_K(sign(M̃))                         (sign-stabilized; NS_K(M̃) if not sign_momentum)
        V ← β₂V + (1−β₂)·O⊙O                      (element-wise, m×n)
        Ô = O / (√(V/(1−β₂ᵗ)) + ε)
        D = √min(m, n)·Ô / (‖Ô‖_F + ε)
        X ← (1 − η·λ)X − a·η·D

    With the default ``lr_adjust="rms"`` (``a = 0.2·√max(m, n)``) the step is the paper's
    RMS-aligned ``0.2·√(mn)·Ô/‖Ô‖_F``: every matrix update has RMS 0.2, so AdamW learning
    rates carry over. The sign transform is the paper's (v2 onward); the official code,
    which we follow for the rest (bias-corrected ``V``, ``β₂ = 0.999``, ``ε = 1e-8``, the
    ``√min(m, n)/(‖Ô‖_F + ε)`` rescaling), predates it: ``sign_momentum=False`` reproduces it.
    The bias correction only matters through ``ε`` (the rescaling cancels it otherwise).
    For conv filters ``min(m, n)`` is taken over the matrix view (the official code takes it
    over the 4-D shape).

    Persistent state per matrix: the momentum buffer, ``exp_avg_sq`` (``V``, in the matrix
    view and the parameter's dtype; the arithmetic runs in at least float32) and ``step``
    (float32), both banked like the momentum; the stacked path (``batching``) takes the sign,
    Newton–Schulz and this update on stacks of same-shape matrices, and no step reads a number
    back to the host. ``use_muon=False`` groups take AdamW.

    Args:
        beta2: decay ``β₂`` ∈ [0, 1) of the element-wise second moment.
        eps: ``ε`` ≥ 0 of both divisions.
        sign_momentum: orthogonalize ``sign(M̃)`` (the paper) rather than ``M̃``.
        Other arguments: as :class:`muoneq.MuonEq` (without ``mode``).
    """

    hyperparameters = {
        **HybridOrthogonalOptimizer.hyperparameters,
        "beta2": Hyper(decay, when="use_muon"),
        "eps": Hyper(nonnegative, when="use_muon"),
        "sign_momentum": Hyper(boolean, when="use_muon"),
    }

    def __init__(self, params: ParamsT, *, beta2: float = 0.999, eps: float = 1e-8,
                 sign_momentum: bool = True, **shared: Unpack[Shared]):
        super().__init__(params, dict(beta2=beta2, eps=eps, sign_momentum=sign_momentum),
                         **shared)

    #: ``V`` and the step counts are banked like the momentum: the stacked path reads them
    #: stacked (the counts in float32, as torch.optim keeps ``step``)
    banked_state = {"exp_avg_sq": Banked(lambda layout: layout.matrix),
                    "step": Banked(lambda layout: (), dtype=lambda _: torch.float32)}

    def prepare(self, M: Tensor, segment: Segment, group: dict, out: Tensor) -> Tensor:
        return torch.sign(M, out=out) if group["sign_momentum"] else M

    finishes_in_ns_dtype = False

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]:
        accumulate = torch.promote_types(dtype, torch.float32)
        elements = [("elements", (count, *shape), accumulate)]
        if dtype != accumulate:  # O⊙O rounded to V's dtype
            elements.append(("squares", (count, *shape), dtype))
        return [*elements, ("correction", (count,), accumulate), ("norm", (count, 1, 1),
                                                                  accumulate)]

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        """``V``'s update and the adaptive, RMS-aligned direction (class docstring) of a stack
        ``O`` ``(k, m, n)`` with its ``V`` and steps ``(k,)``, in ``O`` and the scratch. The
        bias correction ``1 − β₂ᵗ`` is computed on the device, as ``−expm1(t·ln β₂)`` (no host
        read; exact to rounding where ``1 − β₂ᵗ`` is small)."""
        beta2, eps, scratch = group["beta2"], group["eps"], segment.scratch
        v, step, elements = segment.state["exp_avg_sq"], segment.state["step"], scratch["elements"]
        step.add_(1)
        v.lerp_(torch.square(O, out=elements if v.dtype == elements.dtype else scratch["squares"]),
                1 - beta2)
        log_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
        correction = scratch["correction"].copy_(step).mul_(log_beta2).expm1_().neg_()
        O.div_(elements.copy_(v).div_(correction[:, None, None]).sqrt_().add_(eps))
        norm = torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True, out=scratch["norm"])
        return O.mul_(norm.add_(eps).reciprocal_().mul_(math.sqrt(min(O.shape[-2:]))))
