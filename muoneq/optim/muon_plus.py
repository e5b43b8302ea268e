"""Muon+ (Zhang et al., 2026): one column/row normalization step after orthogonalization."""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.newton_schulz import Request
from muoneq.optim.base import Hyper
from muoneq.optim.checks import choice, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared
from muoneq.optim.plan import Segment

#: Post-orthogonalization normalizations, applied left to right ("col_row": columns first).
NORM_MODES = ("none", "col", "row", "col_row", "row_col")


def _norm_mode_key(mode: str) -> str:
    return mode.lower().replace("-", "_")


#: The dimension each normalization of a ``norm_mode`` sums over, in order (-2: columns).
_DIMS = {"col": (-2,), "row": (-1,), "col_row": (-2, -1), "row_col": (-1, -2), "none": ()}


class MuonPlus(HybridOrthogonalOptimizer):
    r"""Muon+: "Towards Better Muon via One Additional Normalization Step" (Zhang, Zhao, Liu,
    Wang, Zhang, 2026, arXiv:2602.21545; official code K1seki221/MuonPlus).

    For a matrix parameter ``X`` (m×n, stored as ``(fan_out, fan_in)``; conv filters as
    ``(out, in·kh·kw)``) with gradient ``G``::

        M ← βM + (1−β)G;          M̃ = βM + (1−β)G (nesterov) or M
        U = NS_K(M̃)
        col:  U_{:,j} ← U_{:,j} / √(Σ_i U_ij² + ε)     row:  U_{i,:} ← U_{i,:} / √(Σ_j U_ij² + ε)
        X ← (1 − η·λ)X − a·η·normalize(U, norm_mode)

    ``norm_mode`` ∈ {"none", "col", "row", "col_row", "row_col"}; "col_row" (columns, then
    rows) is the variant the MuonEq paper compares against and the default here. Muon+ keeps
    no state beyond Muon's momentum. The default shape factor is ``lr_adjust=
    "spectral_unclamped"``, ``a = √(fan_out/fan_in)``; ``ε = norm_eps`` (1e-8, the value of
    the official configurations). The direction depends on ``M̃`` alone, so Muon+ takes the
    stacked path, the DDP split and fused blocks (``splits``) as MuonEq does.

    Args:
        norm_mode: the post-orthogonalization normalization (see above).
        norm_eps: ``ε`` ≥ 0 inside the square roots.
        Other arguments: as :class:`muoneq.MuonEq` (without ``mode``).
    """

    hyperparameters = {
        **HybridOrthogonalOptimizer.hyperparameters,
        "norm_mode": Hyper(choice(*NORM_MODES, normalize=_norm_mode_key), when="use_muon"),
        "norm_eps": Hyper(nonnegative, when="use_muon"),
    }

    shared_defaults = Shared(lr_adjust="spectral_unclamped")

    def __init__(self, params: ParamsT, *, norm_mode: str = "col_row", norm_eps: float = 1e-8,
                 **shared: Unpack[Shared]):
        super().__init__(params, dict(norm_mode=norm_mode, norm_eps=norm_eps), **shared)

    finishes_in_ns_dtype = False

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]:
        accumulate = torch.promote_types(dtype, torch.float32)
        return [("columns", (count, 1, shape[1]), accumulate),
                ("rows", (count, shape[0], 1), accumulate)]

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        """The normalizations of ``norm_mode`` (class docstring) of a stack, in place:
        ``U / √(Σ U² + ε)`` along each dimension in turn, a zero column/row staying zero
        (never 0/0) when ``ε = 0``."""
        for dim in _DIMS[group["norm_mode"]]:
            norm = segment.scratch["columns" if dim == -2 else "rows"]
            torch.linalg.vector_norm(O, dim=dim, keepdim=True, out=norm).square_()
            O.div_(norm.add_(group["norm_eps"]).sqrt_().clamp_(min=torch.finfo(O.dtype).tiny))
        return O
