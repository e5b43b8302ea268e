"""Spectral metrics of a matrix and its exact polar factor (paper Section 2, "Notation").

For ``A ∈ R^{m×n}`` with singular values ``σ_1 ≥ … ≥ σ_r > 0`` (``r`` the numerical rank):

* stable rank ``sr(A) = ‖A‖_F² / ‖A‖_2²``;
* condition numbers ``κ(A) = σ_1/σ_r`` and ``κ_i(A) = σ_1/σ_i``;
* singular-value entropy ``H(p) = −Σ_i p_i log p_i`` with ``p_i = σ_i²/‖A‖_F²``;
* the polar factor ``Orth(A) = U_r V_rᵀ`` (the limit that Newton–Schulz approximates).

Everything is computed from one SVD in float64 (whatever the input dtype) and works on a
matrix or a batch ``(..., m, n)``. The numerical rank counts ``σ_i > rtol·σ_1``; the default
``rtol = max(m, n)·eps(float64)`` is NumPy's ``matrix_rank`` rule for the matrix as given.
Undefined values (the zero matrix) are NaN rather than an error, so a monitor never crashes a
training run on an all-zero momentum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _check_matrix(A: Tensor, what: str) -> None:
    if not isinstance(A, Tensor) or A.ndim < 2:
        shape = tuple(A.shape) if isinstance(A, Tensor) else type(A).__name__
        raise ValueError(
            f"{what}: expected a matrix or a batch of matrices (..., m, n), got {shape}"
        )
    if A.is_complex():
        raise ValueError(f"{what}: complex matrices are not supported (dtype {A.dtype})")


def default_rtol(shape: tuple[int, ...] | torch.Size) -> float:
    """NumPy's ``matrix_rank`` tolerance relative to ``σ_1``: ``max(m, n)·eps(float64)``."""
    return max(shape[-2], shape[-1]) * torch.finfo(torch.float64).eps


@dataclass(frozen=True)
class Spectrum:
    """Singular values of a matrix (or batch) with its numerical rank; metrics as properties.

    ``sigma`` has shape ``(..., min(m, n))``, float64, descending; ``rank`` has shape ``(...)``.
    """

    sigma: Tensor
    rank: Tensor

    @property
    def _in_rank(self) -> Tensor:
        index = torch.arange(self.sigma.size(-1), device=self.sigma.device)
        return index < self.rank.unsqueeze(-1)

    @property
    def frobenius_sq(self) -> Tensor:
        """``‖A‖_F² = Σ_i σ_i²``."""
        return self.sigma.square().sum(-1)

    @property
    def stable_rank(self) -> Tensor:
        """``sr(A) = ‖A‖_F² / σ_1²`` (NaN for the zero matrix)."""
        top = self.sigma[..., 0]
        return torch.where(top > 0, self.frobenius_sq / top.square(), torch.nan)

    @property
    def kappa(self) -> Tensor:
        """``κ_i = σ_1/σ_i`` for every i; ``inf`` beyond the numerical rank."""
        ratio = self.sigma[..., :1] / self.sigma
        return torch.where(self._in_rank, ratio, torch.inf)

    @property
    def condition_number(self) -> Tensor:
        """``κ(A) = σ_1/σ_r`` with ``r`` the numerical rank (NaN for the zero matrix)."""
        last = (self.rank - 1).clamp(min=0).unsqueeze(-1)
        sigma_r = self.sigma.gather(-1, last).squeeze(-1)
        return torch.where(self.rank > 0, self.sigma[..., 0] / sigma_r, torch.nan)

    @property
    def entropy(self) -> Tensor:
        """``H(p) = −Σ_{i≤r} p_i log p_i``, ``p_i = σ_i²/‖A‖_F²`` (natural log; 0 for rank ≤ 1)."""
        p = self.sigma.square() / self.frobenius_sq.unsqueeze(-1)
        terms = torch.where(self._in_rank & (p > 0), -p * p.log(), torch.zeros_like(p))
        return terms.sum(-1)


def _svd(A: Tensor, rtol: float | None, *, vectors: bool):
    _check_matrix(A, "A")
    if rtol is not None and not rtol >= 0:
        raise ValueError(f"rtol: expected a number ≥ 0, got {rtol!r}")
    work = A.to(torch.float64)
    if vectors:
        U, sigma, Vh = torch.linalg.svd(work, full_matrices=False)
    else:
        U, sigma, Vh = None, torch.linalg.svdvals(work), None
    tol = (default_rtol(A.shape) if rtol is None else rtol) * sigma[..., :1]
    rank = ((sigma > tol) & (sigma > 0)).sum(-1)
    return U, Spectrum(sigma, rank), Vh


def spectrum(A: Tensor, rtol: float | None = None) -> Spectrum:
    """Singular values (float64) and numerical rank of ``A`` (``σ_i > rtol·σ_1`` counts)."""
    return _svd(A, rtol, vectors=False)[1]


def svd_polar(A: Tensor, rtol: float | None = None) -> tuple[Tensor, Spectrum]:
    """``(Orth(A), spectrum(A))`` from a single float64 SVD.

    ``Orth(A) = U_r V_rᵀ`` keeps only the ``r`` singular pairs within the numerical rank, so a
    rank-deficient ``A`` maps to a partial isometry (``‖Orth(A)‖_F = √r``), as in the paper.
    """
    U, spec, Vh = _svd(A, rtol, vectors=True)
    index = torch.arange(spec.sigma.size(-1), device=A.device)
    keep = (index < spec.rank.unsqueeze(-1)).to(U.dtype)
    return (U * keep.unsqueeze(-2)) @ Vh, spec


def polar_factor(A: Tensor, rtol: float | None = None) -> Tensor:
    """The exact polar factor ``Orth(A) = U_r V_rᵀ`` in float64 (see :func:`svd_polar`)."""
    return svd_polar(A, rtol)[0]


def stable_rank(A: Tensor) -> Tensor:
    """``sr(A) = ‖A‖_F²/‖A‖_2²`` (float64, shape ``A.shape[:-2]``)."""
    return spectrum(A).stable_rank


def condition_number(A: Tensor, rtol: float | None = None) -> Tensor:
    """``κ(A) = σ_1/σ_r`` over the numerical rank (``rtol`` relative to ``σ_1``)."""
    return spectrum(A, rtol).condition_number


def kappa_i(A: Tensor, rtol: float | None = None) -> Tensor:
    """``κ_i(A) = σ_1/σ_i`` for i = 1..min(m, n); ``inf`` beyond the numerical rank."""
    return spectrum(A, rtol).kappa


def singular_value_entropy(A: Tensor, rtol: float | None = None) -> Tensor:
    """``H(p) = −Σ p_i log p_i`` with ``p_i = σ_i²/‖A‖_F²`` (natural log)."""
    return spectrum(A, rtol).entropy
