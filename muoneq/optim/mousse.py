"""Mousse (Zhang et al., 2026): Muon in coordinates whitened by Kronecker curvature factors."""

from __future__ import annotations

from typing import Unpack

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.layout import MatrixLayout
from muoneq.optim.base import Hyper, matched_by_name
from muoneq.optim.checks import decay, integer, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared
from muoneq.optim.plan import Banked, Segment, is_dtensor


def _eigenbasis(factor: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Eigenpairs of the trace-normalized factor (or of each of a stack), eigenvalues shifted to
    be ≥ ``eps``.

    ``F̂ = F·d/tr(F)`` (``d`` = size; a zero factor stays zero), ``(λ, Q) = eigh(F̂ + εI)``,
    then ``λ ← λ + max(0, −min λ) + ε`` (the official ``clean_eigenvalues``).
    """
    size = factor.shape[-1]
    trace = factor.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    normalized = factor * torch.where(trace > 0, size / trace, 0.0)  # no host sync
    eye = torch.eye(size, dtype=factor.dtype, device=factor.device)
    evals, evecs = torch.linalg.eigh(normalized + eps * eye)
    return evals + (-evals.amin(-1, keepdim=True)).clamp(min=0) + eps, evecs


def _accumulate(factor: Tensor, A: Tensor, B: Tensor, beta: float) -> None:
    """``F ← β·F + (1−β)·A·B`` for one factor or a stack (``addmm``/``baddbmm``)."""
    product = factor.mul_(beta).addmm_ if factor.ndim == 2 else factor.mul_(beta).baddbmm_
    product(A, B, alpha=1 - beta)


def full(t: Tensor) -> Tensor:
    """A whole tensor: a ``DTensor``'s ``full_tensor()`` (FSDP2's gradients), any other itself."""
    return t.full_tensor() if is_dtensor(t) else t


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
        **{key: Banked(shape, dtype=lambda dtype: torch.promote_types(dtype, torch.float32))
           for key, shape in {"L": lambda layout: layout.matrix[:1] * 2,
                              "R": lambda layout: layout.matrix[1:] * 2,
                              "Q_L": lambda layout: layout.matrix[:1] * 2,
                              "Q_R": lambda layout: layout.matrix[1:] * 2,
                              "lambda_L": lambda layout: layout.matrix[:1],
                              "lambda_R": lambda layout: layout.matrix[1:]}.items()},
        "step": Banked(lambda layout: (), dtype=lambda _: torch.float32),
    }

    def _init_matrix_state(self, p: Tensor, state: dict, group: dict) -> None:
        super()._init_matrix_state(p, state, group)
        m, n = MatrixLayout.of(p, group).matrix
        like = {"dtype": torch.promote_types(p.dtype, torch.float32), "device": p.device}
        fresh = {"step": torch.tensor(0.0, dtype=torch.float32)}
        for side, size in (("L", m), ("R", n)):
            fresh[side] = torch.zeros(size, size, **like)
            fresh[f"Q_{side}"] = torch.eye(size, **like)
            fresh[f"lambda_{side}"] = torch.ones(size, **like)
        for key, value in fresh.items():
            if key in state:  # a bank's view (at zero so far)
                state[key].copy_(value)
            else:  # a DTensor's
                state[key] = value

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

    def prepare(self, M: Tensor, segment: Segment, group: dict, out: Tensor) -> Tensor:
        """The factors' update from the gradients (whole: a sharded one is gathered), then the
        whitened ``M̃``."""
        grads = torch.stack([full(p.grad) for p in segment.params])
        G = segment.layout.stacked_blocks(grads)[segment.split].reshape(M.shape)
        return self._whitened(M, G, segment.state, group)

    finishes_in_ns_dtype = False

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        return self._mapped_back(O, segment.state, group)

    @staticmethod
    def _whitened(M: Tensor, G: Tensor, state: dict, group: dict) -> Tensor:
        """The factors' update, their eigenbases when due, and ``W`` (class docstring) of one
        ``M̃`` with its gradient ``G`` and state, or of a stack with its banked state. Which
        matrices are due is read once (a stack's count of them)."""
        L, R, step = state["L"], state["R"], state["step"]
        # contiguous: a strided gradient would take another BLAS path and round differently
        G = G.to(L.dtype).contiguous()
        beta = group["precond_beta"]
        _accumulate(L, G, G.mT, beta)
        _accumulate(R, G.mT, G, beta)
        step.add_(1)
        due = torch.remainder(step - 1, group["precond_every"]) == 0
        count = int(due.sum())
        if count:
            for side in ("L", "R"):
                evals, evecs = _eigenbasis(state[side], group["precond_eps"])
                if count < due.numel():  # some of a stack (a state reset, or loaded)
                    evals = torch.where(due[..., None], evals, state[f"lambda_{side}"])
                    evecs = torch.where(due[..., None, None], evecs, state[f"Q_{side}"])
                state[f"lambda_{side}"].copy_(evals)
                state[f"Q_{side}"].copy_(evecs)
        scale_L, scale_R = Mousse._scales(state, group)
        return scale_L * (state["Q_L"].mT @ M.to(L.dtype) @ state["Q_R"]) * scale_R

    @staticmethod
    def _mapped_back(O: Tensor, state: dict, group: dict) -> Tensor:
        """``U`` grafted to ``‖O‖_F`` (class docstring), of one matrix or a stack."""
        scale_L, scale_R = Mousse._scales(state, group)
        O = O.to(state["L"].dtype)
        U = state["Q_L"] @ (scale_L * O * scale_R) @ state["Q_R"].mT
        norms = (torch.linalg.vector_norm(O, dim=(-2, -1), keepdim=True),
                 torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True))
        return U.mul_(norms[0] / norms[1].clamp(min=torch.finfo(U.dtype).tiny))

    @staticmethod
    def _scales(state: dict, group: dict) -> tuple[Tensor, Tensor]:
        """``Λ_L^{−α}`` as a column and ``Λ_R^{−α}`` as a row (of each matrix of a stack)."""
        return (state["lambda_L"].pow(-group["alpha"]).unsqueeze(-1),
                state["lambda_R"].pow(-group["alpha"]).unsqueeze(-2))
