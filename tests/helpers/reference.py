"""Independent float64 NumPy transcriptions of the paper's equations (the tests' reference).

Written from the paper (Algorithm 1, eq. (4), Theorem 3.1) with explicit
diagonal matrices, deliberately not sharing code with the package.
"""

from __future__ import annotations

import numpy as np

QUINTIC = (3.4445, -4.7750, 2.0315)


def diag_pre_ref(M: np.ndarray, mode: str, eps: float) -> np.ndarray:
    """DiagPre with explicit diagonal matrices D_r^{-1/2}, D_c^{-1/2} (pseudo-inverse at 0)."""

    def inv_sqrt(d):
        out = np.zeros_like(d)
        out[d > 0] = d[d > 0] ** -0.5
        return np.diag(out)

    Dr = inv_sqrt((M * M).sum(axis=1) + eps)
    Dc = inv_sqrt((M * M).sum(axis=0) + eps)
    return {"none": M, "R": Dr @ M, "C": M @ Dc, "RC": Dr @ M @ Dc}[mode]


def ns_ref(G: np.ndarray, coefficients, norm_scale: float = 1.0) -> np.ndarray:
    """X_0 = G/‖G‖_F (tall → wide), X ← (aI + b XXᵀ + c (XXᵀ)²) X for each (a, b, c)."""
    X = G.T if G.shape[0] > G.shape[1] else G
    norm = np.linalg.norm(X)
    X = X / max(norm * norm_scale, 1e-7)
    I = np.eye(X.shape[0])
    for a, b, c in coefficients:
        A = X @ X.T
        X = (a * I + b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def muoneq_ref(X0, grads, *, lr, beta, nesterov, mode, eps, wd, coefficients=(QUINTIC,) * 5,
               scale="rms"):
    """Algorithm 1 in float64 for one m×n matrix (conv filters: pass the reshaped matrix)."""
    m, n = X0.shape
    a = {"rms": 0.2 * np.sqrt(max(m, n)), "spectral": np.sqrt(max(1, m / n)), "none": 1.0}[scale]
    X = X0.astype(np.float64).copy()
    M = np.zeros_like(X)
    for G in grads:
        M = beta * M + (1 - beta) * G
        Mt = beta * M + (1 - beta) * G if nesterov else M
        O = ns_ref(diag_pre_ref(Mt, mode, eps), coefficients)
        X = (1 - lr * wd) * X - a * lr * O
    return X


def polar_ref(G: np.ndarray) -> np.ndarray:
    """Orth(G) = U Vᵀ from the SVD."""
    U, _, Vt = np.linalg.svd(G, full_matrices=False)
    return U @ Vt
