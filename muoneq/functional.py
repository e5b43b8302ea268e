"""MuonEq as functions: Algorithm 1 of the paper for one matrix, line by line, and for a
model's matrices.

    muoneq_update(G, M, …)    lines 5–12: the update direction O_t of one matrix
      M ← βM + (1−β)G             line 5   (in place, ``momentum.lerp_``)
      nesterov_input(G, M, β)     line 7   M̃ = βM + (1−β)G (Nesterov), else M̃ = M
      diag_pre(M̃, mode, ε)        line 11  eq. (4), Algorithm 2
      newton_schulz(M̂, K, …)      line 12  O = NS_K(M̂)      (:mod:`muoneq.newton_schulz`)
    update_parameter(X, O, …)   line 13  X ← (1 − ηλ)X − a·η·O,  a = lr_scale(shape)

:class:`muoneq.MuonEq`'s step runs these same functions for every matrix of a model, as
``torch.optim.Muon.step`` runs ``muon()``: :func:`momentum_input` (lines 6–10),
:func:`directions` (lines 11–12 for each matrix of each stored parameter, one at a time or as
stacks of same-shape matrices: :func:`equilibrate`, then the group's validated
Newton–Schulz, :func:`muoneq.newton_schulz.orthogonalizer`) and :func:`apply_update`
(line 13, block by block). Their optional ``out=``/workspace buffers change where results are
written, not what is computed. Conv filters are matrices viewed as ``(out, in·kh·kw)``
(:func:`matrix_shape`); weights stored otherwise (transposed, expert banks, fused blocks) are
cut into their matrices by :mod:`muoneq.layout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from muoneq.layout import MatrixLayout
from muoneq.newton_schulz import Workspace, newton_schulz, resolve_dtype

#: DiagPre modes (eq. (4)); ``"none"`` is plain Muon.
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
#: The shape factor ``a`` of the update (:func:`lr_scale`).
LR_ADJUST = ("rms", "spectral", "spectral_unclamped", "none")


def muoneq_update(
    grad: Tensor,
    momentum: Tensor,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    mode: str = "R",
    eps: float = 1e-8,
    ns_steps: int = 5,
    ns_coefficients="quintic",
    ns_dtype: torch.dtype | str = "auto",
) -> Tensor:
    """Algorithm 1, lines 5–12, for one m×n matrix: update ``momentum`` in place and return
    the direction ``O_t`` (in ``ns_dtype``; apply it with :func:`update_parameter`)."""
    momentum.lerp_(grad, 1 - beta)                                               # line 5
    m_tilde = nesterov_input(grad, momentum, beta) if nesterov else momentum     # lines 6–10
    balanced = diag_pre(m_tilde, mode, eps)                                      # line 11
    return newton_schulz(balanced, ns_steps, ns_coefficients, ns_dtype)          # line 12


def nesterov_input(grad: Tensor, momentum: Tensor, beta: float, *,
                   out: Tensor | None = None) -> Tensor:
    """Line 7: ``M̃ = βM + (1−β)G`` — ``lerp(G, M, β)``, as torch.optim.Muon writes it."""
    return torch.lerp(grad, momentum, beta, out=out)


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
    """``d^{-1/2}`` with the pseudo-inverse convention ``0 ↦ 0`` (Remark 3.3)."""
    return torch.where(d > 0, d.rsqrt(), 0.0)


def diag_pre(M: Tensor, mode: str = "R", eps: float = 1e-8, *,
             dtype: torch.dtype | str | None = None, out: Tensor | None = None,
             overwrite: bool = False, scratch: Tensor | None = None) -> Tensor:
    """DiagPre (line 11, eq. (4), Algorithm 2) of a matrix or a batch
    ``(..., m, n)``:

        D_r = diag(rowsum(M ⊙ M) + ε),   D_c = diag(colsum(M ⊙ M) + ε)   (both from ``M``)
        RC: D_r^{-1/2} M D_c^{-1/2},   R: D_r^{-1/2} M,   C: M D_c^{-1/2},   none: M

    With ``ε = 0`` a zero row (column) stays zero (pseudo-inverse, Remark 3.3).
    Sums and scaling run in float32 at least (bf16 sums of squares lose too much); the result
    is written once, in ``dtype`` (default ``M``'s), into ``out`` when given — the optimizer
    fuses the cast to the Newton–Schulz dtype this way. ``overwrite`` lets the scaling happen
    in ``M`` itself (scratch); column sums square ``M`` into ``scratch`` first (float32 at
    least, ``M``'s shape; allocated when not given).
    """
    mode = canonical_mode(mode)
    dtype = M.dtype if dtype is None else resolve_dtype(dtype, M.device)
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


def matrix_shape(p: Tensor) -> tuple[int, int]:
    """``(out, in·kh·kw)``: the 2-D view under which a ≥2-D parameter is orthogonalized."""
    return (p.shape[0], math.prod(p.shape[1:]))


def lr_scale(shape: tuple[int, int], lr_adjust: str) -> float:
    """The factor ``a`` multiplying the learning rate of an m×n matrix update.

    ``"rms"``: ``0.2·√max(m, n)`` (Moonlight's, the paper's ``a``: the update's RMS matches
    AdamW's); ``"spectral"``: ``√max(1, m/n)`` (Keller Jordan's); ``"spectral_unclamped"``:
    ``√(m/n)`` = √(fan_out/fan_in) (Bernstein's, Muon+'s); ``"none"``: 1.
    """
    m, n = shape
    if lr_adjust == "rms":
        return 0.2 * math.sqrt(max(m, n))
    if lr_adjust == "spectral":
        return math.sqrt(max(1.0, m / n))
    if lr_adjust == "spectral_unclamped":
        return math.sqrt(m / n)
    if lr_adjust == "none":
        return 1.0
    raise ValueError(f"lr_adjust: unknown value {lr_adjust!r}; allowed: {', '.join(LR_ADJUST)}")


def update_parameter(param: Tensor, direction: Tensor, *, lr: float, weight_decay: float,
                     scale: float, buffer: Tensor | None = None) -> None:
    """Line 13: ``X ← (1 − η·λ)·X − a·η·O`` in place (decoupled weight decay, unscaled ``η``).

    ``direction`` is reshaped to ``param``'s shape; one in another dtype is first cast into
    ``buffer`` when given (adding it directly would allocate that cast: same values).
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    direction = direction.reshape(param.shape)
    if direction.dtype != param.dtype and buffer is not None:
        if buffer.untyped_storage().data_ptr() != direction.untyped_storage().data_ptr():
            direction = buffer.copy_(direction)
    param.add_(direction, alpha=-lr * scale)


# ----------------------------------------------------------------------------- a model's matrices
@dataclass(frozen=True)
class UpdateSettings:
    """What lines 5–13 read from one param group (the executors never see the group)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    lr_adjust: str


def momentum_input(grad: Tensor, momentum: Tensor, settings: UpdateSettings, *,
                   out: Tensor) -> Tensor:
    """Lines 6–10 into ``out``: ``M̃ = lerp(G, M, β)`` with Nesterov, else a copy of ``M``
    (``M̃`` is scratch a direction may overwrite; the momentum buffer is state)."""
    if settings.nesterov:
        return nesterov_input(grad, momentum, settings.momentum, out=out)
    return out.copy_(momentum)


def equilibrate(m_tilde: Tensor, *, mode: str, eps: float, dtype: torch.dtype,
                workspace: Workspace | None) -> Tensor:
    """Line 11 as the optimizer runs it: :func:`diag_pre` of ``M̃`` (scratch, scaled in place),
    written once in the Newton–Schulz ``dtype``; a single matrix's result and column squares
    live in ``workspace`` (a stack, or no workspace, allocates its own)."""
    out = scratch = None
    if workspace is not None and m_tilde.ndim == 2:
        out = workspace.take("balanced", m_tilde.shape, dtype, m_tilde.device)
        if mode in ("C", "RC"):
            scratch = workspace.take("squares", m_tilde.shape,
                                     torch.promote_types(m_tilde.dtype, torch.float32),
                                     m_tilde.device)
    return diag_pre(m_tilde, mode, eps, dtype=dtype, out=out, overwrite=True, scratch=scratch)


def apply_update(value: Tensor, direction: Tensor, layout: MatrixLayout,
                 settings: UpdateSettings, *, start: int = 0,
                 workspace: Workspace | None = None) -> None:
    """Line 13 on ``value`` (the stored parameter, or rows ``start:`` of it held by this rank),
    ``direction`` in the stored layout (a direction in another dtype is cast into the
    workspace's ``M̃`` buffer, free by now).

    Each block of the layout is updated with the shape factor of its own ``(rows, n)``, on a
    contiguous ``(rows, in, k…)`` copy when the stored block is not one, so that it gets
    exactly the update of the same weights stored as an ``nn.Linear``.
    """
    if layout.plain:
        pieces = [(layout.matrix, value, direction)]
    else:
        direction = direction.reshape(value.shape)
        pieces = [(shape, v, d) for (shape, v), (_, d) in
                  zip(layout.pieces(value, start), layout.pieces(direction, start),
                      strict=True)]
    for shape, target, d in pieces:
        work = target if target.is_contiguous() else target.contiguous()
        buffer = None if workspace is None else workspace.take(
            "m_tilde", work.shape, work.dtype, work.device)
        update_parameter(work, d, lr=settings.lr, weight_decay=settings.weight_decay,
                         scale=lr_scale(shape, settings.lr_adjust), buffer=buffer)
        if work is not target:
            target.copy_(work)
