"""MuonEq (paper Algorithm 1): equilibrate the momentum with DiagPre, then orthogonalize."""

from __future__ import annotations

from typing import Unpack

from torch.optim.optimizer import ParamsT

from muoneq.functional import canonical_mode
from muoneq.newton_schulz import canonical_algorithm, check_runs
from muoneq.optim.base import Hyper
from muoneq.optim.checks import boolean, converted, nonnegative
from muoneq.optim.hybrid import HybridOrthogonalOptimizer, Shared


class MuonEq(HybridOrthogonalOptimizer):
    r"""MuonEq: balancing before orthogonalization (Chang et al., 2026).

    For every matrix parameter ``X`` (m×n; conv filters as ``(out, in·kh·kw)``) with gradient
    ``G`` one step is Algorithm 1 with the EMA momentum convention — what
    :func:`muoneq.functional.step_stacks` runs (:func:`~muoneq.functional.muoneq_update` for
    one matrix):

    1. ``M ← βM + (1−β)G``; ``M̃ = βM + (1−β)G`` if ``nesterov`` else ``M``;
    2. ``M̂ = DiagPre(M̃, mode, ε)`` (eq. (4)): R ``D_r^{-1/2}M̃``,
       C ``M̃D_c^{-1/2}``, RC ``D_r^{-1/2}M̃D_c^{-1/2}``, none ``M̃`` (plain Muon);
    3. ``O = NS_K(M̂)`` with ``K = ns_steps`` and the chosen coefficients, in ``ns_dtype``;
    4. ``X ← (1 − η·λ)X − a·η·O`` with ``a = 0.2·√max(m, n)`` (``lr_adjust="rms"``).

    Parameter groups with ``use_muon=False`` are updated by AdamW with the group's ``lr``,
    ``adamw_betas``, ``adamw_eps`` and ``weight_decay``. The only persistent state of a matrix
    parameter is its momentum buffer: DiagPre is recomputed from ``M̃`` each step.

    Args:
        params: parameters or param groups (see :func:`muoneq.param_groups`, which also sets
            the group keys ``transposed``, ``batch_dims`` and ``splits`` of weights stored
            other than ``(out, in·…)``: :mod:`muoneq.layout`). Every other argument is
            keyword-only; those before ``distributed`` are also per-group keys.
        lr: learning rate ``η``.
        momentum: ``β`` in [0, 1).
        nesterov: use the Nesterov input ``M̃`` (the paper's "-Nes" variants).
        mode: DiagPre mode, one of ``"none"``, ``"R"`` (default), ``"C"``, ``"RC"``
            (case-insensitive; ``"row"``, ``"col"``, ``"rowcol"`` accepted).
        eps: stability term ``ε`` ≥ 0 added to the row/column sums of squares.
        ns_steps: Newton–Schulz steps ``K`` ≥ 1.
        ns_coefficients: ``"quintic"``, ``"taylor"``, ``"polar_express"``, ``(a, b, c)`` or a
            list of ``ns_steps`` tuples (see :mod:`muoneq.newton_schulz`).
        ns_dtype: dtype of the Newton–Schulz iteration: ``"auto"`` (default: bfloat16 on
            accelerators and on CPUs with native bf16 products, float32 on other CPUs;
            :data:`muoneq.newton_schulz.AUTO_DTYPE`), a ``torch.dtype`` or its name.
        weight_decay: decoupled weight decay ``λ`` (multiplied by the unscaled ``lr``).
        lr_adjust: ``"rms"`` (``0.2·√max(m,n)``), ``"spectral"`` (``√max(1, m/n)``),
            ``"spectral_unclamped"`` (``√(m/n)``) or ``"none"`` (1); see
            :func:`muoneq.functional.lr_scale`.
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
            (one matrix per chunk, Newton–Schulz in torch.optim.Muon's operations: with
            ``mode="none"`` and bf16, its weights bit for bit) or ``"stacked"`` (same-shape
            matrices in one batched Newton–Schulz call).
        workspace_limit: bytes of scratch the step may keep between steps
            (``optimizer.workspace_bytes``): chunks of same-shape matrices hold as many as fit
            (one parameter at least); ``"auto"`` (default): twice what torch.optim.Muon's step
            takes for the largest matrix (:func:`muoneq.optim.plan.muon_step_bytes`);
            ``None``: no bound (up to 2²⁶ elements per chunk).
        ns_backend: who runs the Newton–Schulz products: ``"torch"`` (default), ``"triton"``
            (this project's kernels, CUDA), ``"auto"`` (on a GPU, per shape, the faster that
            agrees) or a callable ``backend(X, coefficients) -> Tensor``
            (:data:`muoneq.newton_schulz.NS_BACKENDS`); ``ns_algorithm="gram"`` needs torch's.
        capturable: a step with no host synchronization, which a CUDA graph can capture
            (``torch.optim``'s flag; a per-group key): ``lr`` and ``weight_decay`` may be 0-d
            device tensors, read on the device (change them in place between steps, as LR
            schedulers do), AdamW's step counters live on the device (a change in which matrices
            have a gradient plans the step again: do not capture that step).
        compile: ``torch.compile`` the step (opt-in; rounds slightly differently from eager):
            each chunk's prologue (``M̃`` staged, DiagPre, the normalization, the cast) and its
            update, ``fullgraph=True, dynamic=False`` (one graph per shape and stage, compiled
            at the first step; a new ``lr`` compiles nothing).
        process_group: the group to split replicated matrices over (default: the world).
    """

    hyperparameters = {
        **HybridOrthogonalOptimizer.hyperparameters,
        "mode": Hyper(converted(canonical_mode), when="use_muon"),
        "eps": Hyper(nonnegative, when="use_muon"),
        "ns_algorithm": Hyper(converted(canonical_algorithm), when="use_muon"),
        "capturable": Hyper(boolean),
    }
    added_keys = {**HybridOrthogonalOptimizer.added_keys, "ns_algorithm": "standard",
                  "capturable": False}

    def __init__(self, params: ParamsT, *, mode: str = "R", eps: float = 1e-8,
                 ns_algorithm: str = "standard", capturable: bool = False,
                 compile: bool = False, **shared: Unpack[Shared]):
        if not isinstance(compile, bool):
            raise ValueError(f"compile: expected True or False, got {compile!r}")
        self.compile = compile
        super().__init__(params, dict(mode=mode, eps=eps, ns_algorithm=ns_algorithm,
                                      capturable=capturable), **shared)

    def _options(self) -> dict:
        return {**super()._options(), "compile": self.compile}

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        if group["use_muon"]:
            check_runs(group["ns_algorithm"], self.ns_backend)
        if group["capturable"] and self.compile:
            raise ValueError("capturable: compile=True's graphs are not captured with it yet; "
                             "use capturable=False or compile=False")
