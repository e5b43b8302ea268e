"""MuonEq as functions: Algorithm 1 of the paper for one matrix, line by line.

    muoneq_update(G, M, …)    lines 5–12: the update direction O_t of one matrix
      M ← βM + (1−β)G             line 5   (in place, ``momentum.lerp_``)
      nesterov_input(G, M, β)     line 7   M̃ = βM + (1−β)G (Nesterov), else M̃ = M
      diag_pre(M̃, mode, ε)        line 11  eq. (4), Algorithm 2
      newton_schulz(M̂, K, …)      line 12  O = NS_K(M̂)      (:mod:`muoneq.newton_schulz`)
    update_parameter(X, O, …)   line 13  X ← (1 − ηλ)X − a·η·O,  a = lr_scale(shape)

:class:`muoneq.MuonEq` runs these same functions for every matrix of a model (its fast paths
pass the optional ``out=``/workspace buffers, which change where results are written, not
what is computed). Conv filters are matrices viewed as ``(out, in·kh·kw)``
(:func:`matrix_shape`); weights stored otherwise (transposed, expert banks, fused blocks) are
cut into their matrices by :mod:`muoneq.layout`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from muoneq.newton_schulz import newton_schulz, resolve_dtype

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
