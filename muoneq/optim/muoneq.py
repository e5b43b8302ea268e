"""MuonEq (paper Algorithm 1): equilibrate the momentum with DiagPre, then orthogonalize."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from muoneq.equilibration import canonical_mode, diag_pre
from muoneq.newton_schulz import newton_schulz
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, _number


class MuonEq(HybridOrthogonalOptimizer):
    r"""MuonEq: balancing before orthogonalization (Chang et al., 2026).

    For every matrix parameter ``X`` (m×n; conv filters as ``(out, in·kh·kw)``) with gradient
    ``G`` one step is (Algorithm 1 with the EMA momentum convention):

    1. ``M ← βM + (1−β)G``; ``M̃ = βM + (1−β)G`` if ``nesterov`` else ``M``;
    2. ``M̂ = DiagPre(M̃, mode, ε)`` (eq. ``diagpre_family``): R ``D_r^{-1/2}M̃``,
       C ``M̃D_c^{-1/2}``, RC ``D_r^{-1/2}M̃D_c^{-1/2}``, none ``M̃`` (plain Muon);
    3. ``O = NS_K(M̂)`` with ``K = ns_steps`` and the chosen coefficients, in ``ns_dtype``;
    4. ``X ← (1 − η·λ)X − a·η·O`` with ``a = 0.2·√max(m, n)`` (``lr_adjust="rms"``).

    Parameter groups with ``use_muon=False`` are updated by AdamW with the group's ``lr``,
    ``adamw_betas``, ``adamw_eps`` and ``weight_decay``. The only persistent state of a matrix
    parameter is its momentum buffer: DiagPre is recomputed from ``M̃`` each step.

    Args:
        params: parameters or param groups (see :func:`muoneq.param_groups`).
        lr: learning rate ``η``.
        momentum: ``β`` in [0, 1).
        nesterov: use the Nesterov input ``M̃`` (the paper's "-Nes" variants).
        mode: DiagPre mode, one of ``"none"``, ``"R"`` (default), ``"C"``, ``"RC"``
            (case-insensitive; ``"row"``, ``"col"``, ``"rowcol"`` accepted).
        eps: stability term ``ε`` ≥ 0 added to the row/column sums of squares.
        ns_steps: Newton–Schulz steps ``K`` ≥ 0.
        ns_coefficients: ``"quintic"``, ``"taylor"``, ``"polar_express"``, ``(a, b, c)`` or a
            list of ``ns_steps`` tuples (see :mod:`muoneq.newton_schulz`).
        ns_dtype: dtype of the Newton–Schulz iteration (a ``torch.dtype`` or its name).
        weight_decay: decoupled weight decay ``λ`` (multiplied by the unscaled ``lr``).
        lr_adjust: ``"rms"`` (``0.2·√max(m,n)``), ``"spectral"`` (``√max(1, m/n)``) or ``"none"``.
        adamw_betas, adamw_eps: AdamW settings of ``use_muon=False`` groups.
    """

    _extra_defaults = {"mode": "R", "eps": 1e-8}

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        mode: str = "R",
        eps: float = 1e-8,
        ns_steps: int = 5,
        ns_coefficients="quintic",
        ns_dtype=torch.bfloat16,
        weight_decay: float = 0.1,
        lr_adjust: str = "rms",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ):
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            lr_adjust=lr_adjust, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
            mode=mode, eps=eps,
        )

    def _validate_extra(self, group: dict) -> None:
        group["mode"] = canonical_mode(group["mode"])
        _number(group, "eps")

    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        balanced = diag_pre(m_tilde, group["mode"], group["eps"])
        return newton_schulz(
            balanced, group["ns_steps"], group["ns_coefficients"], group["ns_dtype"]
        )
