"""MuonEq (paper Algorithm 1): equilibrate the momentum with DiagPre, then orthogonalize."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from muoneq.equilibration import canonical_mode, pinv_rsqrt
from muoneq.newton_schulz import (
    canonical_algorithm,
    ns_flops,
    resolve_dtype,
    resolve_schedule,
    run_schedule,
)
from muoneq.optim.contract import check_number
from muoneq.optim.hybrid import HybridOrthogonalOptimizer


def diag_pre_cast(M: Tensor, mode: str, eps: float, dtype: torch.dtype,
                  out: Tensor | None = None, overwrite: bool = False,
                  scratch: Tensor | None = None) -> Tensor:
    """:func:`muoneq.equilibration.diag_pre` fused with the cast to the Newton–Schulz dtype.

    The same map (eq. ``diagpre_family``: row/column sums of ``M⊙M`` from the same ``M`` plus
    ``eps``, pseudo-inverse at 0, arithmetic in float32 at least), but the result is written
    once in ``dtype`` (into ``out`` when given). With ``overwrite`` the scaling happens in
    ``M`` itself (scratch). Row sums are one reduction; column sums square ``M`` into
    ``scratch`` (float32 at least, ``M``'s shape; allocated when not given) first. ``mode`` is
    canonical (:func:`~muoneq.equilibration.canonical_mode`); works on batches ``(..., m, n)``.
    """
    if out is None:
        out = torch.empty(M.shape, dtype=dtype, device=M.device)
    if mode == "none":
        return out.copy_(M)
    work = M if M.dtype in (torch.float32, torch.float64) else M.float()
    scales = []
    if mode in ("R", "RC"):
        scales.append(torch.linalg.vector_norm(work, dim=-1, keepdim=True).square_())
    if mode in ("C", "RC"):
        # square, then sum: torch's norm over the strided dimension is ~9× slower on CPU
        scales.append(torch.square(work, out=scratch).sum(dim=-2, keepdim=True))
    scales = [pinv_rsqrt(d.add_(eps)) for d in scales]
    inplace = overwrite or work is not M
    if len(scales) == 2:
        work = work.mul_(scales[0]) if inplace else work * scales[0]
    if inplace and out.dtype != work.dtype:  # torch.mul(out=) would allocate the cast
        return out.copy_(work.mul_(scales[-1]))
    return torch.mul(work, scales[-1], out=out)


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
        ns_algorithm: evaluation order of the Newton–Schulz polynomial (a per-group key):
            ``"standard"`` (default; torch.optim.Muon's operations, bit for bit) or ``"gram"``
            (opt-in: carried on the m×m Gram matrix where that is cheaper, 0.67–0.75× the
            matmul FLOPs on 1:3–1:4 matrices; the same polynomial rounded differently in
            bf16, no less accurate than the standard order in our measurements; see
            :data:`muoneq.newton_schulz.GRAM_RESTART`).
        distributed: ``"auto"`` (split the matrices between DDP ranks when torch.distributed
            is initialized), ``True`` (the same, but require a process group) or ``False``
            (every rank computes every matrix). Row-sharded FSDP2 parameters always gather
            whole matrices. See :class:`~muoneq.optim.hybrid.HybridOrthogonalOptimizer`.
        batching: ``"auto"`` (stacked on accelerators, per matrix on CPU), ``"per_matrix"``
            or ``"stacked"`` (same-shape matrices in one batched Newton–Schulz call).
        compile: run Newton–Schulz through ``torch.compile`` (opt-in; fuses the scaling and
            casts on GPU, rounds slightly differently from eager).
        process_group: the group to split replicated matrices over (default: the world).
    """

    _extra_defaults = {"mode": "R", "eps": 1e-8, "ns_algorithm": "standard"}
    added_keys = {"ns_algorithm": "standard"}
    stateless_direction = True

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
        *,
        ns_algorithm: str = "standard",
        distributed: bool | str = "auto",
        batching: str = "auto",
        compile: bool = False,
        process_group=None,
    ):
        if not isinstance(compile, bool):
            raise ValueError(f"compile: expected True or False, got {compile!r}")
        self.compile = compile
        super().__init__(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            lr_adjust=lr_adjust, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
            mode=mode, eps=eps, ns_algorithm=ns_algorithm, distributed=distributed,
            batching=batching, process_group=process_group,
        )

    def _reset_caches(self) -> None:
        super()._reset_caches()
        self._compiled = torch.compile(run_schedule) if self.compile else None

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "compile": self.compile}

    def _validate_extra(self, group: dict) -> None:
        group["mode"] = canonical_mode(group["mode"])
        check_number(group, "eps")
        group["ns_algorithm"] = canonical_algorithm(group["ns_algorithm"])

    def _direction_flops(self, shape: tuple[int, int], group: dict) -> float:
        """Newton–Schulz in the group's order plus DiagPre's ~4mn."""
        return ns_flops(shape, group["ns_steps"], group["ns_algorithm"]) + 4.0 * math.prod(shape)

    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        """``NS_K(DiagPre(M̃))`` in ``ns_dtype``, for one matrix or a stack ``(B, m, n)``."""
        dtype = resolve_dtype(group["ns_dtype"])
        schedule = resolve_schedule(group["ns_coefficients"], group["ns_steps"])
        if self._compiled is not None:
            balanced = diag_pre_cast(m_tilde, group["mode"], group["eps"], dtype)
            return self._compiled(balanced, schedule, dtype, algorithm=group["ns_algorithm"])
        # one matrix: temporaries in the optimizer's workspace (a stack allocates its own)
        ws = self._workspace if m_tilde.ndim == 2 else None
        out = scratch = None
        if ws is not None:
            out = ws.take("balanced", m_tilde.shape, dtype, m_tilde.device)
            if group["mode"] in ("C", "RC"):
                scratch = ws.take("squares", m_tilde.shape,
                                  torch.promote_types(m_tilde.dtype, torch.float32),
                                  m_tilde.device)
        balanced = diag_pre_cast(m_tilde, group["mode"], group["eps"], dtype, out=out,
                                 overwrite=True, scratch=scratch)
        return run_schedule(balanced, schedule, dtype, workspace=ws,
                            algorithm=group["ns_algorithm"])
