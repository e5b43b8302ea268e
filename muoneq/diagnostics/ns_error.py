"""Finite-step Newton–Schulz error, its lower bound (the paper's Theorem 3.1) and
eq. (5).

For a matrix ``M`` and a normalization ``S ∈ {none, R, C, RC}`` (DiagPre, eq. (4)) the paper
splits the distance of the update direction from the unpreconditioned polar factor as

    ‖NS_K(S(M)) − Orth(M)‖_F ≤ ‖NS_K(S(M)) − Orth(S(M))‖_F + ‖Orth(S(M)) − Orth(M)‖_F
                                 (finite-step error)          (preconditioning bias)

and Theorem 3.1 bounds the finite-step error from below through the spectrum of the
matrix fed to Newton–Schulz: with ``X_0 = G/α`` (α = ‖G‖_F, times the schedule's safety factor)
and step coefficients ``(a_j, b_j, c_j)``,

    ‖X_k − Orth(G)‖_F / √r ≥ ( Σ_i (1 − P_k·σ_i/α)_+² )^{1/2} / √r,   P_k = Π_{j<k} a_j,

where ``σ_i/‖G‖_F = 1/(κ_i·√sr(G))``. The paper states it for one (a, b, c) (``P_k = a^k``); the
proof goes through step by step, so per-step schedules (Polar Express) are covered as long as
every step satisfies its hypothesis ``a_j > 1, 0 < q_j(t) = a_j + b_j t + c_j t² ≤ a_j`` on [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from muoneq.diagnostics.metrics import Spectrum, svd_polar
from muoneq.functional import MODES, canonical_mode, diag_pre
from muoneq.newton_schulz import (
    NSSchedule,
    newton_schulz_iterates,
    normalize_coefficients,
    resolve_dtype,
    resolve_schedule,
)


def theorem_applies(a: float, b: float, c: float) -> bool:
    """Whether one step's coefficients meet Theorem 3.1: ``a > 1``, ``0 < q ≤ a`` on [0, 1].

    ``q(t) ≤ a`` on [0, 1] ⟺ ``b ≤ 0`` and ``b + c ≤ 0``; ``q > 0`` is checked at ``t = 1`` and,
    when ``c > 0``, at the vertex ``t* = −b/(2c)`` if it lies inside (0, 1).
    """
    if not a > 1 or b > 0 or b + c > 0 or a + b + c <= 0:
        return False
    if c > 0 and 0 < -b / (2 * c) < 1:
        return a - b * b / (4 * c) > 0
    return True


def _schedule(steps: int, coefficients) -> NSSchedule:
    return resolve_schedule(normalize_coefficients(coefficients, steps), steps)


def ns_lower_bound(spec: Spectrum, steps: int = 5, coefficients="quintic") -> Tensor:
    """Theorem 3.1's lower bound on the *relative* error ``‖X_k − Orth(G)‖_F/√r``, k = 0..K.

    ``spec`` is the :class:`~muoneq.diagnostics.metrics.Spectrum` of the matrix fed to
    Newton–Schulz (batched spectra give a ``(..., K+1)`` result). Raises ``ValueError`` when a
    step's coefficients fall outside the theorem's hypothesis (:func:`theorem_applies`).
    """
    schedule = _schedule(steps, coefficients)
    bad = [i for i, abc in enumerate(schedule.coefficients) if not theorem_applies(*abc)]
    if bad:
        raise ValueError(
            f"coefficients: step(s) {bad} of {schedule.coefficients} violate Theorem 3.1 "
            "(needs a > 1 and 0 < a + b·t + c·t² ≤ a on [0, 1]); no lower bound is proven"
        )
    alpha = schedule.norm_scale * spec.frobenius_sq.sqrt()
    s0 = spec.sigma / alpha.unsqueeze(-1)
    growth = torch.tensor(
        [math.prod(a for a, _, _ in schedule.coefficients[:k]) for k in range(steps + 1)],
        dtype=s0.dtype, device=s0.device,
    )
    gap = (1 - growth.unsqueeze(-1) * s0.unsqueeze(-2)).clamp(min=0)  # (..., K+1, min(m, n))
    index = torch.arange(s0.size(-1), device=s0.device)
    gap = gap * (index < spec.rank.unsqueeze(-1)).unsqueeze(-2)
    rank = spec.rank.clamp(min=1).to(gap.dtype).unsqueeze(-1)
    return (gap.square().sum(-1) / rank).sqrt()


@dataclass(frozen=True)
class ModeDiagnostics:
    """The geometry and the error budget of one normalization ``S`` applied to ``M``.

    Curves run over the Newton–Schulz steps k = 0..K: ``finite_step_curve[k] =
    ‖X_k − Orth(S(M))‖_F`` and ``total_curve[k] = ‖X_k − Orth(M)‖_F``; ``bias =
    ‖Orth(S(M)) − Orth(M)‖_F`` (eq. (5): ``total ≤ finite_step + bias`` at every k).
    ``bound_curve`` is Theorem 3.1's lower bound on the relative finite-step error (NaN
    where the coefficients fall outside the theorem). Spectral metrics are those of ``S(M)``.
    """

    mode: str
    rank: int
    stable_rank: float
    condition_number: float
    entropy: float
    bias: float
    finite_step_curve: tuple[float, ...]
    total_curve: tuple[float, ...]
    bound_curve: tuple[float, ...]

    @property
    def relative_curve(self) -> tuple[float, ...]:
        """``‖X_k − Orth(S(M))‖_F / ‖Orth(S(M))‖_F`` (= ``/√r``), what the paper's Figures 1
        and 2 plot."""
        root_r = math.sqrt(max(self.rank, 1))
        return tuple(e / root_r for e in self.finite_step_curve)

    @property
    def relative_error(self) -> float:
        """``‖NS_K(S(M)) − Orth(S(M))‖_F / √r`` at the last step K."""
        return self.relative_curve[-1]

    @property
    def finite_step_error(self) -> float:
        """``‖NS_K(S(M)) − Orth(S(M))‖_F`` at the last step K."""
        return self.finite_step_curve[-1]

    @property
    def total_error(self) -> float:
        """``‖NS_K(S(M)) − Orth(M)‖_F`` at the last step K."""
        return self.total_curve[-1]


def error_decomposition(
    M: Tensor,
    modes=MODES,
    steps: int = 5,
    coefficients="quintic",
    ns_dtype: torch.dtype | str = torch.float64,
    eps: float = 1e-8,
    rtol: float | None = None,
) -> dict[str, ModeDiagnostics]:
    """Eq. (5) and Theorem 3.1 for every normalization in ``modes``.

    ``M`` (one m×n matrix) is moved to float64; ``S(M)`` is :func:`muoneq.diag_pre` with ``eps``;
    Newton–Schulz runs in ``ns_dtype`` with the optimizer's coefficients, one pass recording
    every iterate; exact polar factors come from float64 SVDs with rank tolerance ``rtol``
    (see :mod:`muoneq.diagnostics.metrics`).
    """
    if not isinstance(M, Tensor) or M.ndim != 2:
        shape = tuple(M.shape) if isinstance(M, Tensor) else type(M).__name__
        raise ValueError(f"M: expected one matrix (m, n), got {shape}")
    if isinstance(modes, str):
        modes = (modes,)
    modes = list(dict.fromkeys(canonical_mode(m) for m in modes))
    schedule = _schedule(steps, coefficients)
    bound_ok = all(theorem_applies(*abc) for abc in schedule.coefficients)
    dtype = resolve_dtype(ns_dtype)
    M = M.to(torch.float64)
    orth_m, spec_m = svd_polar(M, rtol)
    out = {}
    for mode in modes:
        S = diag_pre(M, mode, eps)
        orth_s, spec = (orth_m, spec_m) if mode == "none" else svd_polar(S, rtol)
        finite, total = [], []
        for X in newton_schulz_iterates(S, steps, coefficients, dtype):
            X = X.to(torch.float64)
            finite.append(float((X - orth_s).norm()))
            total.append(float((X - orth_m).norm()))
        bound = (
            ns_lower_bound(spec, steps, coefficients).tolist() if bound_ok
            else [math.nan] * (steps + 1)
        )
        out[mode] = ModeDiagnostics(
            mode=mode,
            rank=int(spec.rank),
            stable_rank=float(spec.stable_rank),
            condition_number=float(spec.condition_number),
            entropy=float(spec.entropy),
            bias=float((orth_s - orth_m).norm()),
            finite_step_curve=tuple(finite),
            total_curve=tuple(total),
            bound_curve=tuple(bound),
        )
    return out
