"""Mousse (Zhang et al., 2026): Muon in coordinates whitened by Kronecker curvature factors."""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.newton_schulz import Request
from muoneq.optim.base import Hyper, matched_by_name
from muoneq.optim.checks import decay, integer, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared
from muoneq.optim.plan import Banked, Segment


def _refresh(factor: Tensor, values: Tensor, vectors: Tensor, due: Tensor, count: int,
             scratch: dict[str, Tensor], side: str, eps: float) -> None:
    """The eigenbasis of the trace-normalized factors of a stack whose refresh is ``due``
    (``count`` of them), eigenvalues shifted to be ≥ ``eps``, into ``values`` and ``vectors``.

    ``F̂ = F·d/tr(F)`` (``d`` = size; a zero factor stays zero), ``(λ, Q) = eigh(F̂ + εI)``,
    then ``λ ← λ + max(0, −min λ) + ε`` (the official ``clean_eigenvalues``).
    """
    trace = torch.sum(factor.diagonal(dim1=-2, dim2=-1), dim=-1, out=scratch["trace"])
    flat = torch.le(trace, 0, out=scratch["flat"])
    ratio = trace.reciprocal_().mul_(factor.size(-1)).masked_fill_(flat, 0.0)  # no host sync
    evecs = torch.mul(factor, ratio[:, None, None], out=scratch["vectors_" + side])
    evecs.diagonal(dim1=-2, dim2=-1).add_(eps)
    evals = scratch["values_" + side]
    torch.linalg.eigh(evecs, out=(evals, evecs))
    shift = torch.amin(evals, dim=-1, keepdim=True, out=scratch["shift"]).neg_().clamp_(min=0)
    evals.add_(shift).add_(eps)
    if count == due.numel():
        values.copy_(evals)
        vectors.copy_(evecs)
    else:  # some of a stack (a state reset, or loaded)
        torch.where(due[:, None], evals, values, out=values)
        torch.where(due[:, None, None], evecs, vectors, out=vectors)


def _accumulate(factor: Tensor, A: Tensor, B: Tensor, beta: float) -> None:
    """``F ← β·F + (1−β)·A·B`` for a stack of factors (``baddbmm``)."""
    factor.mul_(beta).baddbmm_(A, B, alpha=1 - beta)


def _identity(shape: tuple[int, int], **like) -> Tensor:
    return torch.eye(shape[0], **like)


#: State kept in at least float32 whatever the parameter's dtype.
_CURVATURE_KEYS = frozenset({"L", "R", "Q_L", "Q_R", "lambda_L", "lambda_R"})


class Mousse(HybridOrthogonalOptimizer):
    r"""Mousse: "Rectifying the Geometry of Muon with Curvature-Aware Preconditioning"
    (Zhang et al., 2026, arXiv:2603.09697; official code Anti-Entrophic/Mousse).

    For a matrix parameter ``X`` (m×n; conv filters as ``(out, in·kh·kw)``) with gradient ``G``,
    at step ``t``::

        M ← βM + (1−β)G;          M̃ = βM + (1−β)G (nesterov) or M
        L ← β_p L + (1−β_p) G Gᵀ,   R ← β_p R + (1−β_p) GᵀG                 (m×m, n×n)
        every T steps (t = 1, T+1, 2T+1, …), for F ∈ {L, R}:
            F̂ = F/(1−β_pᵗ), trace-normalized to F̂·d/tr(F̂);  (Λ_F, Q_F) = eigh(F̂ + εI),
            Λ_F ← Λ_F + max(0, −min Λ_F) + ε
        W = Λ_L^{−α} Q_Lᵀ M̃ Q_R Λ_R^{−α}                                      (whiten)
        O = NS_K(W)
        U = Q_L Λ_L^{−α} O Λ_R^{−α} Q_Rᵀ                                      (map back)
        X ← (1 − η·λ)X − a·η·U·‖O‖_F/‖U‖_F                                    (graft)

    (``T = precond_every``, ``β_p = precond_beta``, ``ε = precond_eps``, ``α = alpha``.)
    The bias correction ``1/(1−β_pᵗ)`` cancels in the trace normalization, so it is not
    computed. Defaults follow the official implementation and its released configuration:
    α = 0.125, T = 10, β_p = 0.95, ε = 1e-5, ``nesterov=False``, ``lr_adjust=
    "spectral_unclamped"`` (their ``adjust_lr="spectral_norm"``, ``a = √(m/n)``). Their
    momentum ``M ← βM + G`` differs from the EMA by a constant factor, which whitening, NS
    and grafting all ignore. ``NS_K`` is the group's schedule (``ns_coefficients``); the
    official code runs Dion's five tuned tuples, which can be passed as an explicit list.
    Factors and eigenbases are kept in float32 (float64 for float64 parameters).

    Persistent state per matrix (heavy: m² + n² floats twice): the momentum buffer,
    ``L``, ``R``, their eigenbases ``Q_L``, ``Q_R``, eigenvalues ``lambda_L``, ``lambda_R``,
    and ``step``, banked like the momentum. The stacked path (``batching``) runs all of the
    above on stacks of same-shape matrices, one batched ``torch.linalg.eigh`` per shape and
    side when due; whether one is due is the one number a step reads back (per shape).
    ``use_muon=False`` groups take AdamW.

    Args:
        alpha: whitening exponent ``α`` ≥ 0 (0 gives Muon).
        precond_beta: EMA decay ``β_p`` ∈ [0, 1) of the Kronecker factors.
        precond_eps: damping ``ε`` ≥ 0 of the eigendecomposition.
        precond_every: refresh period ``T`` ≥ 1 of the eigendecomposition.
        Other arguments: as :class:`muoneq.MuonEq` (without ``mode``).
    """

    hyperparameters = {
        **HybridOrthogonalOptimizer.hyperparameters,
        "alpha": Hyper(nonnegative, when="use_muon"),
        "precond_beta": Hyper(decay, when="use_muon"),
        "precond_eps": Hyper(nonnegative, when="use_muon"),
        "precond_every": Hyper(integer(1), when="use_muon"),
    }

    shared_defaults = Shared(nesterov=False, lr_adjust="spectral_unclamped")

    def __init__(self, params: ParamsT, *, alpha: float = 0.125, precond_beta: float = 0.95,
                 precond_eps: float = 1e-5, precond_every: int = 10, **shared: Unpack[Shared]):
        super().__init__(params, dict(alpha=alpha, precond_beta=precond_beta,
                                      precond_eps=precond_eps, precond_every=precond_every),
                         **shared)

    #: The curvature state and the step counts are banked like the momentum, in at least
    #: float32 (the counts in float32): the stacked path reads them stacked.
    banked_state = {
        **{key: Banked(shape, dtype=lambda dtype: torch.promote_types(dtype, torch.float32),
                       initial=initial)
           for key, (shape, initial) in {
               "L": (lambda layout: layout.matrix[:1] * 2, torch.zeros),
               "R": (lambda layout: layout.matrix[1:] * 2, torch.zeros),
               "Q_L": (lambda layout: layout.matrix[:1] * 2, _identity),
               "Q_R": (lambda layout: layout.matrix[1:] * 2, _identity),
               "lambda_L": (lambda layout: layout.matrix[:1], torch.ones),
               "lambda_R": (lambda layout: layout.matrix[1:], torch.ones)}.items()},
        "step": Banked(lambda layout: (), dtype=lambda _: torch.float32),
    }
    reads_gradient = True
    finishes_in_ns_dtype = False

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the curvature state keeps its own
        (≥ float32) dtype: the base class would cast it to the dtype of a bf16 parameter."""
        state_dict = matched_by_name(state_dict, self.param_groups)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = {i: dict(state_dict["state"].get(i, {})) for i in saved_ids}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            dtype = torch.promote_types(p.dtype, torch.float32)
            for key in _CURVATURE_KEYS.intersection(saved[saved_id]):
                self.state[p][key] = saved[saved_id][key].to(device=p.device, dtype=dtype)

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]:
        m, n = shape
        like = torch.promote_types(dtype, torch.float32)
        return [("whitened", (count, m, n), like), ("scale_L", (count, m), like),
                ("scale_R", (count, n), like), ("due", (count,), like),
                ("due_mask", (count,), torch.bool), ("due_count", (), like),
                ("trace", (count,), like), ("flat", (count,), torch.bool),
                ("shift", (count, 1), like), ("values_L", (count, m), like),
                ("vectors_L", (count, m, m), like), ("values_R", (count, n), like),
                ("vectors_R", (count, n, n), like), ("norm", (count, 1, 1), like),
                ("mapped_norm", (count, 1, 1), like)]

    def prepare(self, M: Tensor, segment: Segment, group: dict, out: Tensor) -> Tensor:
        """The factors' update from the gradients, their eigenbases when due, and the whitened
        ``M̃``, ``W`` (class docstring), of a stack with its banked state. Which matrices are due
        is read once (their count)."""
        state, scratch, G = segment.state, segment.scratch, segment.gradient
        beta = group["precond_beta"]
        _accumulate(state["L"], G, G.mT, beta)
        _accumulate(state["R"], G.mT, G, beta)
        step = state["step"].add_(1)
        due = torch.sub(step, 1, out=scratch["due"]).remainder_(group["precond_every"])
        due = torch.eq(due, 0, out=scratch["due_mask"])
        count = int(torch.sum(due, dim=0, out=scratch["due_count"]))
        if count:
            for side in ("L", "R"):
                _refresh(state[side], state["lambda_" + side], state["Q_" + side], due, count,
                         scratch, side, group["precond_eps"])
        scale_L = torch.pow(state["lambda_L"], -group["alpha"], out=scratch["scale_L"])
        scale_R = torch.pow(state["lambda_R"], -group["alpha"], out=scratch["scale_R"])
        whitened = torch.bmm(state["Q_L"].mT, M, out=scratch["whitened"])
        return torch.bmm(whitened, state["Q_R"], out=out).mul_(scale_L[:, :, None]).mul_(
            scale_R[:, None, :])

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        """``U`` grafted to ``‖O‖_F`` (class docstring) of a stack, in ``O`` and the scratch
        (the scales :meth:`prepare` left there)."""
        state, scratch = segment.state, segment.scratch
        norm = torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True, out=scratch["norm"])
        O.mul_(scratch["scale_L"][:, :, None]).mul_(scratch["scale_R"][:, None, :])
        mapped = torch.bmm(state["Q_L"], O, out=scratch["whitened"])
        U = torch.bmm(mapped, state["Q_R"].mT, out=O)
        mapped_norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True,
                                               out=scratch["mapped_norm"])
        return U.mul_(norm.div_(mapped_norm.clamp_(min=torch.finfo(U.dtype).tiny)))
