"""NorMuon (Li et al., 2025): Muon followed by a per-row (neuron-wise) adaptive normalization."""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.newton_schulz import Request
from muoneq.optim.base import Hyper
from muoneq.optim.checks import decay, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared
from muoneq.optim.plan import Banked, Segment


class NorMuon(HybridOrthogonalOptimizer):
    r"""NorMuon: "Making Muon more efficient and scalable" (Li, Liu, Liang, Chen, Zhao, 2025,
    arXiv:2510.05491; official code zichongli5/NorMuon).

    For a matrix parameter ``X`` (m×n; conv filters as ``(out, in·kh·kw)``) with gradient ``G``::

        M ← βM + (1−β)G;          M̃ = βM + (1−β)G (nesterov) or M
        O = NS_K(M̃)
        v ← β₂v + (1−β₂)·mean_cols(O⊙O)          (v ∈ ℝ^m: one value per row / neuron)
        Ô = O / (√v + ε)                          (row i divided by √v_i + ε)
        Ô ← Ô·‖O‖_F / (‖Ô‖_F + ε)                 (the update keeps Muon's Frobenius norm)
        X ← (1 − η·λ)X − a·η·Ô

    as in the official ``normuon_update``: no bias correction of ``v``, ``ε = 1e-10`` in both
    divisions. ``a`` is the shape factor chosen by ``lr_adjust``: the default ``"rms"``
    (0.2·√max(m, n)) gives an update of RMS ≈ 0.2, the paper's RMS-matched step
    ``η̂ = 0.2·η·√(mn)/‖Ô‖_F`` up to ``‖O‖_F ≈ √min(m, n)``; the official script uses Keller
    Jordan's factor instead (pass ``lr_adjust="spectral"``).
    Unlike the official code, which takes the row mean of a conv filter over its last axis
    only, the second moment of a conv filter is kept per output channel of the matrix view.

    Persistent state per matrix: the momentum buffer and ``second_moment`` (m×1, in the
    parameter's dtype as in the official code; the arithmetic runs in at least float32).
    ``use_muon=False`` groups take AdamW (see
    :class:`~muoneq.optim.hybrid.HybridOrthogonalOptimizer`).

    Args:
        beta2: decay ``β₂`` ∈ [0, 1) of the per-row second moment.
        eps: ``ε`` ≥ 0 of the two divisions.
        Other arguments: as :class:`muoneq.MuonEq` (without ``mode``).
    """

    hyperparameters = {
        **HybridOrthogonalOptimizer.hyperparameters,
        "beta2": Hyper(decay, when="use_muon"),
        "eps": Hyper(nonnegative, when="use_muon"),
    }

    def __init__(self, params: ParamsT, *, beta2: float = 0.95, eps: float = 1e-10,
                 **shared: Unpack[Shared]):
        super().__init__(params, dict(beta2=beta2, eps=eps), **shared)

    #: the second moments are banked like the momentum: the stacked path reads them stacked
    banked_state = {"second_moment": Banked(lambda layout: (layout.matrix[0], 1))}

    finishes_in_ns_dtype = False

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]:
        accumulate = torch.promote_types(dtype, torch.float32)
        rows = [("rows", (count, shape[0], 1), accumulate)]
        if dtype != accumulate:  # the row means rounded to the second moment's dtype
            rows.append(("moment", (count, shape[0], 1), dtype))
        return [*rows, ("norm", (count, 1, 1), accumulate),
                ("normalized_norm", (count, 1, 1), accumulate)]

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        """The second moment's update and the row normalization (class docstring) of a stack
        ``O`` ``(k, m, n)`` with its ``v`` ``(k, m, 1)``, in ``O`` and the scratch."""
        eps, scratch, v = group["eps"], segment.scratch, segment.state["second_moment"]
        rows = scratch["rows"]
        means = torch.linalg.vector_norm(O, dim=-1, keepdim=True, out=rows).square_().div_(
            O.size(-1))
        v.lerp_(means if v.dtype == means.dtype else scratch["moment"].copy_(means),
                1 - group["beta2"])
        norm = torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True, out=scratch["norm"])
        O.div_(rows.copy_(v).sqrt_().add_(eps))
        normalized = torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True,
                                              out=scratch["normalized_norm"])
        return O.mul_(norm.div_(normalized.add_(eps)))
