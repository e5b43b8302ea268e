"""DiagPre: the row/column equilibration of MuonEq (paper eq. ``diagpre_family``, Algorithm 2).

For the (Nesterov-mixed) momentum ``M̃`` of an m×n weight,

    D_r = diag(rowsum(M̃ ⊙ M̃) + ε),      D_c = diag(colsum(M̃ ⊙ M̃) + ε),

both computed from the *same* ``M̃``, and

    RC: D_r^{-1/2} M̃ D_c^{-1/2},    R: D_r^{-1/2} M̃,    C: M̃ D_c^{-1/2}.

With ``ε = 0`` a zero row (column) has a zero diagonal entry; we use the pseudo-inverse
(Remark ``rem:r_main``): that row stays zero instead of becoming NaN.
The map is stateless and costs two reductions and one or two broadcasts.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("none", "R", "C", "RC")
_ALIASES = {
    "none": "none",
    "r": "R",
    "row": "R",
    "c": "C",
    "col": "C",
    "column": "C",
    "rc": "RC",
    "rowcol": "RC",
    "row_col": "RC",
}


def canonical_mode(mode) -> str:
    """Map a user spelling (``"r"``, ``"row"``, ``"RowCol"``, …) to one of :data:`MODES`.

    ``None`` is an error, not plain Muon: ask for that with ``"none"``."""
    key = mode.lower() if isinstance(mode, str) else None
    if key not in _ALIASES:
        raise ValueError(
            f"mode: unknown value {mode!r}; allowed: none, R (row), C (col), RC (rowcol), "
            "case-insensitive"
        )
    return _ALIASES[key]


def pinv_rsqrt(d: Tensor) -> Tensor:
    """``d^{-1/2}`` with the pseudo-inverse convention ``0 ↦ 0`` (Remark ``rem:r_main``)."""
    return torch.where(d > 0, d.rsqrt(), 0.0)


def diag_pre(M: Tensor, mode: str = "R", eps: float = 1e-8) -> Tensor:
    """Apply DiagPre to a matrix or a batch of matrices ``(..., m, n)``; returns a new tensor.

    Reductions run in float32 at least (bf16 sums of squares lose too much), the result
    has ``M``'s dtype.
    """
    mode = canonical_mode(mode)
    if mode == "none":
        return M
    work = M if M.dtype in (torch.float32, torch.float64) else M.float()
    sq = work.square()
    out = work
    if mode in ("R", "RC"):
        out = out * pinv_rsqrt(sq.sum(dim=-1, keepdim=True) + eps)
    if mode in ("C", "RC"):
        out = out * pinv_rsqrt(sq.sum(dim=-2, keepdim=True) + eps)
    return out.to(M.dtype)
