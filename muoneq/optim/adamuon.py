"""AdaMuon (Si et al., 2025): element-wise second moment on the orthogonalized update."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.layout import MatrixLayout
from muoneq.newton_schulz import Backend, Coefficients
from muoneq.optim.base import Hyper, arguments
from muoneq.optim.checks import boolean, decay, nonnegative
from muoneq.optim.hybrid import DEFAULTS, HybridOrthogonalOptimizer


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
    view and the parameter's dtype; the arithmetic runs in at least float32) and ``step``.
    ``use_muon=False`` groups take AdamW.

    Args:
        beta2: decay ``β₂`` ∈ [0, 1) of the element-wise second moment.
        eps: ``ε`` ≥ 0 of both divisions.
        sign_momentum: orthogonalize ``sign(M̃)`` (the paper) rather than ``M̃``.
        Other arguments: as :class:`muoneq.MuonEq` (without ``mode``).
    """

    hyperparameters = {
        "beta2": Hyper(decay, when="use_muon"),
        "eps": Hyper(nonnegative, when="use_muon"),
        "sign_momentum": Hyper(boolean, when="use_muon"),
    }

    def __init__(self, params: ParamsT, *, lr: float | Tensor = DEFAULTS.lr,
                 momentum: float = DEFAULTS.momentum, nesterov: bool = DEFAULTS.nesterov,
                 weight_decay: float = DEFAULTS.weight_decay, ns_steps: int = DEFAULTS.ns_steps,
                 ns_coefficients: Coefficients = DEFAULTS.ns_coefficients,
                 ns_dtype: str | torch.dtype = DEFAULTS.ns_dtype,
                 lr_adjust: str = DEFAULTS.lr_adjust,
                 adamw_betas: tuple[float, float] = DEFAULTS.adamw_betas,
                 adamw_eps: float = DEFAULTS.adamw_eps, beta2: float = 0.999,
                 eps: float = 1e-8, sign_momentum: bool = True,
                 distributed: bool | str = DEFAULTS.distributed,
                 batching: str = DEFAULTS.batching, ns_backend: Backend = DEFAULTS.ns_backend,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__(params, **arguments(locals()))

    def _init_matrix_state(self, p: Tensor, state: dict, group: dict) -> None:
        super()._init_matrix_state(p, state, group)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg_sq"] = p.new_zeros(MatrixLayout.of(p, group).matrix)

    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        v = state["exp_avg_sq"]
        beta2, eps = group["beta2"], group["eps"]
        source = m_tilde.sign() if group["sign_momentum"] else m_tilde
        O = self._orthogonalizer(group, source.device)(source)
        O = O.to(torch.promote_types(p.dtype, torch.float32))
        state["step"] += 1
        v.lerp_(O.square().to(v.dtype), 1 - beta2)
        bias_correction2 = 1 - beta2 ** state["step"].item()
        adapted = O / ((v.to(O.dtype) / bias_correction2).sqrt() + eps)
        return adapted.mul_(math.sqrt(min(v.shape)) / (adapted.norm() + eps))
