"""MuonEq as functions: Algorithm 1 of the paper, what the optimizers run.

    muoneq_update(G, M, …)      lines 5–12 for one matrix: the update direction O_t
      M ← βM + (1−β)G               line 5   (in place, ``momentum.lerp_``)
      nesterov_input(G, M, β)       line 7   M̃ = βM + (1−β)G (Nesterov), else M̃ = M
      diag_pre(M̃, mode, ε)          line 11  eq. (4), Algorithm 2 (a matrix or a stack)
      NS_K                          line 12  (:mod:`muoneq.newton_schulz`)
    update_parameter(X, O, …)     line 13  X ← (1 − ηλ)X − a·η·O,  a = lr_scale(shape)

    step_stacks(…)              Algorithm 1 for every matrix of a planned param group: what
                                ``optimizer.step()`` calls, as torch.optim.Muon.step calls muon()
      decay_weights (line 13's 1 − ηλ), then line 5: every matrix at once, a foreach each
      stage_banks(chunks, …)        line 7 for banks stored other than (out, in·…)
      then per chunk of same-shape matrices
      prologue(chunk, …)            lines 6–11: M̃ staged, the method's prepare, diag_pre
                                    (written once in the NS dtype, normalized for NS)
      chunk.iteration.iterate(…)    line 12: the chunk's Newton–Schulz backend
      finished(chunk, …)            the method's finish (NorMuon's, Muon+'s, …)
      update(chunk, …)              line 13 (or, under DDP, the directions into the buffer
                                    sent to every rank, which applies them after the exchange)

A single matrix is a stack of one: ``muoneq_update`` runs the same ``diag_pre`` and the same
iterations as the optimizer. The chunks, their buffers and update lists are planned once by
:mod:`muoneq.optim.plan`; their ``out=`` buffers change where results are written, not what is
computed. Conv filters are matrices viewed as ``(out, in·kh·kw)`` (:func:`matrix_shape`);
weights stored otherwise (transposed, expert banks, fused blocks) are cut into their matrices by
:mod:`muoneq.layout`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from muoneq.newton_schulz import (
    NORM_EPS,
    NSSettings,
    Request,
    buffers_for,
    iteration_for,
    normalize,
    ns_settings,
    resolve_dtype,
)

if TYPE_CHECKING:
    from muoneq.optim.plan import Chunk, Segment

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
#: DiagPre's sides per mode: the dimension summed for ``D_r`` (-1) and ``D_c`` (-2).
SIDES = {"none": (), "R": (-1,), "C": (-2,), "RC": (-1, -2)}
#: The shape factor ``a`` of the update (:func:`lr_scale`).
LR_ADJUST = ("rms", "spectral", "spectral_unclamped", "none")


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


def is_dtensor(t) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (slow to
    import): no DTensor can exist before that module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local part (its shard, or its copy where
    it is replicated: the tensor itself, ``to_local()`` would dispatch a view on every call),
    any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


# ----------------------------------------------------------------------------- one matrix
def nesterov_input(grad: Tensor, momentum: Tensor, beta: float) -> Tensor:
    """Line 7: ``M̃ = βM + (1−β)G`` — ``lerp(G, M, β)``, as torch.optim.Muon writes it."""
    return torch.lerp(grad, momentum, beta)


@dataclass(frozen=True)
class DiagPreBuffers:
    """Scratch of :func:`diag_pre` on a stack ``(k, m, n)``: per side (-1: rows, -2: columns)
    the sums of squares, ``sums + ε`` and the scales; ``squares`` (the column sums' scratch) and
    ``scaled`` (RC's ``D_r^{-1/2}M̃``), both ``(k, m, n)`` in the accumulation dtype; ``norm``,
    ``(k, 1, 1)`` (:func:`diag_pre_requests`)."""

    sums: dict[int, Tensor]
    shifted: dict[int, Tensor]
    scales: dict[int, Tensor]
    squares: Tensor | None
    scaled: Tensor | None
    norm: Tensor


def diag_pre_requests(count: int, shape: tuple[int, int], mode: str, accumulate: torch.dtype,
                      dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of the :class:`DiagPreBuffers` of ``count`` matrices (``dtype``:
    the result's; R's and C's norm is taken in ``accumulate``, from the sums) — ``scaled`` is
    the caller's (the plan gives RC its chunk's stack)."""
    rows, n = shape
    requests = []
    for dim in SIDES[mode]:
        side = (count, rows, 1) if dim == -1 else (count, 1, n)
        requests += [(f"{name}{dim}", side, accumulate) for name in ("sums", "shifted", "scales")]
        if dim == -2:
            requests.append(("squares", (count, rows, n), accumulate))
    requests.append(("norm", (count, 1, 1), accumulate if mode in ("R", "C") else dtype))
    return requests


def diag_pre_buffers(taken: dict[str, Tensor], mode: str,
                     scaled: Tensor | None = None) -> DiagPreBuffers:
    """The :class:`DiagPreBuffers` among ``taken`` (buffers of :func:`diag_pre_requests`)."""
    sides = SIDES[mode]
    return DiagPreBuffers({d: taken[f"sums{d}"] for d in sides},
                          {d: taken[f"shifted{d}"] for d in sides},
                          {d: taken[f"scales{d}"] for d in sides}, taken.get("squares"),
                          scaled, taken["norm"])


def diag_pre(M: Tensor, mode: str = "R", eps: float = 1e-8, *,
             dtype: torch.dtype | str | None = None, out: Tensor | None = None,
             buffers: DiagPreBuffers | None = None, normalize_for: float | None = None
             ) -> Tensor:
    """DiagPre (line 11, eq. (4), Algorithm 2) of a matrix or a stack ``(..., m, n)``:

        D_r = diag(rowsum(M ⊙ M) + ε),   D_c = diag(colsum(M ⊙ M) + ε)   (both from ``M``)
        RC: D_r^{-1/2} M D_c^{-1/2},   R: D_r^{-1/2} M,   C: M D_c^{-1/2},   none: M

    With ``ε = 0`` a zero row (column) stays zero (pseudo-inverse, Remark 3.3). Sums and scaling
    run in float32 at least (bf16 sums of squares lose too much); the result is written once,
    in ``dtype`` (default ``M``'s), into ``out`` when given. ``M`` is read only.

    ``normalize_for=s`` also scales the result for Newton–Schulz, ``X₀ = M̂/max(s·‖M̂‖_F,
    ε_NS)`` per matrix, in the same write: for R (and C) the norm needs no pass over the
    matrix, ``‖D_r^{-1/2}M‖²_F = Σᵢ rᵢ/(rᵢ+ε)`` from the row sums ``rᵢ`` (zero rows add 0),
    folded into the scale vector; RC and none compute it. The optimizer's step calls this with
    its chunk's buffers (``buffers``); without them they are allocated.
    """
    mode = canonical_mode(mode)
    shape = M.shape
    dtype = M.dtype if dtype is None else resolve_dtype(dtype, M.device)
    src = M if M.ndim == 3 else M.reshape(-1, *shape[-2:])
    if src.dtype not in (torch.float32, torch.float64):
        src = src.float()
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=M.device)
    X = out if out.ndim == 3 else out.view(src.shape)
    if buffers is None:
        taken = {name: torch.empty(size, dtype=t, device=M.device) for name, size, t in
                 diag_pre_requests(src.size(0), tuple(src.shape[-2:]), mode, src.dtype, dtype)}
        buffers = diag_pre_buffers(taken, mode, torch.empty_like(src) if mode == "RC" else None)
    sides = SIDES[mode]
    if len(sides) == 1:  # R or C: one scale vector, the norm folded into it
        (dim,) = sides
        sums = _sums_of_squares(src, dim, buffers)
        scales = _inverse_roots(sums, buffers.shifted[dim], buffers.scales[dim], eps)
        if normalize_for is not None:
            ratios = (sums.div_(buffers.shifted[dim]) if eps > 0
                      else sums.mul_(scales).mul_(scales))
            norm = torch.sum(ratios, dim=(-2, -1), keepdim=True, out=buffers.norm).sqrt_()
            if normalize_for != 1:
                norm.mul_(normalize_for)
            scales.div_(norm.clamp_(min=NORM_EPS))
        torch.mul(src, scales, out=X)
        return out
    if sides:  # RC: both scales from the unscaled M, then the norm of the result
        rows = _inverse_roots(_sums_of_squares(src, -1, buffers), buffers.shifted[-1],
                              buffers.scales[-1], eps)
        cols = _inverse_roots(_sums_of_squares(src, -2, buffers), buffers.shifted[-2],
                              buffers.scales[-2], eps)
        torch.mul(torch.mul(src, rows, out=buffers.scaled), cols, out=X)
    elif X is not src:
        X.copy_(src)
    if normalize_for is not None:
        normalize(X, normalize_for, norm=buffers.norm)
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are views of the same elements (no operation dispatched)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _sums_of_squares(src: Tensor, dim: int, buffers: DiagPreBuffers) -> Tensor:
    """``Σ M²`` along ``dim`` (-1: each row's, -2: each column's); columns square into
    scratch first (torch's norm over the strided dimension is ~9× slower on CPU)."""
    out = buffers.sums[dim]
    if dim == -1:
        return torch.linalg.vector_norm(src, dim=-1, keepdim=True, out=out).square_()
    return torch.sum(torch.square(src, out=buffers.squares), dim=-2, keepdim=True, out=out)


def _inverse_roots(sums: Tensor, shifted: Tensor, out: Tensor, eps: float) -> Tensor:
    """``(sums + ε)^{-1/2}`` into ``out`` (``shifted`` keeps ``sums + ε``); with ``ε = 0`` a
    zero sum gives 0, the pseudo-inverse of Remark 3.3."""
    torch.rsqrt(torch.add(sums, eps, out=shifted), out=out)
    return out.nan_to_num_(nan=0.0, posinf=0.0) if eps == 0 else out


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
    the direction ``O_t`` (in ``ns_dtype``; apply it with :func:`update_parameter`). The
    functions of the optimizer's step, on a stack of one matrix."""
    momentum.lerp_(grad, 1 - beta)                                               # line 5
    m_tilde = nesterov_input(grad, momentum, beta) if nesterov else momentum     # lines 6–10
    ns = ns_settings(ns_steps, ns_coefficients, ns_dtype, device=grad.device)
    X = diag_pre(m_tilde[None], mode, eps, dtype=ns.dtype,                       # line 11
                 normalize_for=ns.schedule.norm_scale)
    iteration = iteration_for(ns, tuple(m_tilde.shape), per_matrix=True)         # line 12
    return iteration.iterate(X, ns.schedule.coefficients, buffers_for(iteration, X))[0]


def update_parameter(param: Tensor, direction: Tensor, *, lr: float, weight_decay: float,
                     scale: float) -> None:
    """Line 13: ``X ← (1 − η·λ)·X − a·η·O`` in place (decoupled weight decay, unscaled ``η``;
    ``direction`` reshaped to ``param``'s shape)."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(direction.reshape(param.shape), alpha=-lr * scale)


# ----------------------------------------------------------------------------- a planned group
class Rule(Protocol):
    """A method's map around Newton–Schulz (every optimizer of :mod:`muoneq.optim`), batched
    over the rows of a chunk that belong to one :class:`~muoneq.optim.plan.Segment`.

    ``prepare(M, segment, group, out)`` returns what Newton–Schulz orthogonalizes (before
    DiagPre) from ``M̃`` (``M``, read only; ``out`` is scratch of its shape and dtype);
    ``finish(O, segment, group)`` returns the directions from the Newton–Schulz output ``O``,
    which it may overwrite: ``O`` comes in the NS dtype where ``finishes_in_ns_dtype``, else
    contiguous in the accumulation dtype (float32 at least). Both write only into buffers the
    plan holds — ``segment.scratch``, the rows of what :meth:`requests` named for the chunk,
    and the segment's banked ``state`` — so that a step allocates nothing;
    ``segment.gradient`` holds the gradients ``(k, m, n)`` where ``reads_gradient``."""

    finishes_in_ns_dtype: bool
    reads_gradient: bool

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]: ...

    def prepare(self, M: Tensor, segment: Segment, group: dict, out: Tensor) -> Tensor: ...

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor: ...


def step_stacks(chunks: list[Chunk], params: list[Tensor], grads: list[Tensor],
                momenta: list[Tensor], *, rule: Rule, group: dict, lr: float | Tensor,
                weight_decay: float | Tensor, beta: float, nesterov: bool, mode: str,
                eps: float, ns: NSSettings, decay: Tensor | None = None,
                compiled: dict | None = None, sent: list[Tensor] | None = None) -> None:
    """Algorithm 1 for every matrix of a planned group (the module docstring's outline):
    ``params``, ``grads`` and ``momenta`` of the matrices with a gradient, in the plan's order,
    ``chunks`` their stacks (:mod:`muoneq.optim.plan`). ``compiled``: ``torch.compile``'d
    prologues and updates by ``(stage, shape)`` (``compile=True``). ``sent``: the buffers each
    chunk's directions are copied into instead of line 13, under DDP (``chunks``: those of the
    matrices this rank owns; :func:`muoneq.optim.distributed.step_exchanged` applies every
    rank's after the exchange)."""
    decay_weights(params, lr, weight_decay, decay)                  # line 13's (1 − ηλ), first
    torch._foreach_lerp_(momenta, grads, 1 - beta)                  # line 5, every matrix
    stage_banks(chunks, nesterov, beta)
    compiled = compiled or {}
    for i, chunk in enumerate(chunks):
        X = compiled.get(("prologue", chunk.shape), prologue)(
            chunk, rule, group, nesterov=nesterov, beta=beta, eps=eps, mode=mode,
            norm_scale=ns.schedule.norm_scale)                      # lines 6–11
        O = chunk.iteration.iterate(X, ns.schedule.coefficients, chunk.ns_buffers)  # line 12
        directions = finished(chunk, O, rule, group)
        if sent is None:
            update(chunk, directions, lr, compiled.get(("update", chunk.shape)))  # line 13
        else:
            sent[i].copy_(directions)


def decay_weights(params: list[Tensor], lr: float | Tensor, weight_decay: float | Tensor,
                  out: Tensor | None) -> None:
    """Line 13's ``X ← (1 − η·λ)·X`` for every parameter (one foreach call); with a tensor
    ``η`` or ``λ`` (``capturable``) the factor is computed on the device into ``out``."""
    if not isinstance(lr, Tensor) and not isinstance(weight_decay, Tensor):
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        return
    first, second = (lr, weight_decay) if isinstance(lr, Tensor) else (weight_decay, lr)
    torch._foreach_mul_(params, torch.mul(first, second, out=out).neg_().add_(1))


def stage_banks(chunks: list[Chunk], nesterov: bool, beta: float) -> None:
    """Line 7 for the banks whose ``M̃`` is formed outside the stacks (stored other than
    ``(out, in·…)``, or below float32): the gradients gathered into the bank's ``gather``, then
    ``M̃ = lerp(G, M, β)`` there (with the momentum already updated)."""
    if not nesterov:
        return
    for chunk in chunks:
        for params, gather, momentum in chunk.stages:  # the runs with a gradient
            torch.stack([local(p.grad) for p in params], out=gather)
            gather.lerp_(momentum, beta)


def prologue(chunk: Chunk, rule: Rule, group: dict, *, nesterov: bool, beta: float, eps: float,
             mode: str, norm_scale: float) -> Tensor:
    """Lines 6–11 and Newton–Schulz's normalization for one chunk: ``M̃`` staged into its stack
    (Nesterov from the gathered gradients, or copied), the gradients where the method reads
    them, each segment's ``rule.prepare``, then :func:`diag_pre` written once in the NS dtype
    (``chunk.ns_input``)."""
    for segment in chunk.segments:
        if segment.gather is not None and nesterov:  # M̃ formed in the stack itself
            torch.stack([local(p.grad) for p in segment.params], out=segment.gather)
            segment.gather.lerp_(segment.momentum, beta)
        elif segment.source is not None:
            segment.stack.copy_(segment.source)
        if segment.gradient_stack is not None:
            torch.stack([local(p.grad) for p in segment.params], out=segment.gradient_stack)
        if segment.gradient_copy is not None:
            segment.gradient_copy[0].copy_(segment.gradient_copy[1])
    source, whole = chunk.source, len(chunk.segments) == 1
    for segment in chunk.segments:
        rows = source if whole else source[segment.rows]
        out = chunk.stack if whole else chunk.stack[segment.rows]
        X = rule.prepare(rows, segment, group, out)
        if X is not rows:  # the method made its own input: the stack holds it
            if X is not out:
                out.copy_(X)
            source = chunk.stack
    return diag_pre(source, mode, eps, out=chunk.ns_input, buffers=chunk.diag,
                    normalize_for=norm_scale)


def finished(chunk: Chunk, O: Tensor, rule: Rule, group: dict) -> Tensor:
    """The directions of a chunk from its Newton–Schulz output ``O``: each segment's
    ``rule.finish`` (given ``O`` as :class:`Rule` says: cast into the chunk's stack where the
    method computes in the accumulation dtype); where one returns another tensor, the chunk's
    stack holds the results."""
    if not rule.finishes_in_ns_dtype and (O.dtype != chunk.stack.dtype
                                          or not O.is_contiguous()):
        O = chunk.stack.copy_(O)
    if len(chunk.segments) == 1:
        D = rule.finish(O, chunk.segments[0], group)
        return D if D is O or _same(D, chunk.stack) else chunk.stack.copy_(D)
    parts = [(segment, rows, rule.finish(rows, segment, group))
             for segment, rows in ((s, O[s.rows]) for s in chunk.segments)]
    if all(D is rows for _, rows, D in parts):
        return O
    for segment, _, D in parts:
        target = chunk.stack[segment.rows]
        if not _same(D, target):
            target.copy_(D)
    return chunk.stack


def update(chunk: Chunk, directions: Tensor, lr: float | Tensor,
           compiled: Callable | None = None) -> None:
    """Line 13's ``X ← X − a·η·O`` for every matrix of the chunk (the decay came first), read
    from the buffer of the last iterate where it has the parameters' dtype, else from the
    chunk's stack (copied there). A tensor ``η`` (``capturable``) scales the directions on the
    device first, as a compiled :func:`add_directions` does (``compiled``: ``−a·η`` as a
    tensor, so a new ``η`` compiles nothing)."""
    if directions is chunk.final and chunk.final_readable:
        buffer, pick = directions, 0
    else:
        buffer = (chunk.stack if _same(directions, chunk.stack)
                  else chunk.stack.copy_(directions))
        pick = 1
    if isinstance(lr, Tensor):
        alpha = torch.mul(lr, -chunk.scale, out=chunk.step)
    elif compiled is not None:
        alpha = chunk.step.fill_(-lr * chunk.scale)
    else:
        alpha = -lr * chunk.scale
    (compiled or add_directions)(chunk, buffer, pick, alpha)


def add_directions(chunk: Chunk, buffer: Tensor, pick: int, alpha: float | Tensor) -> None:
    """``X ← X + α·O`` from the chunk's directions (``buffer``; ``pick``: which of its update
    lists read it, 0 the last iterate's, 1 the stack's), a tensor ``α`` multiplied into the
    directions first; staged banks are written back to their stored layout and updated whole."""
    if isinstance(alpha, Tensor):
        buffer.mul_(alpha)
        alpha = 1.0
    if chunk.targets:
        torch._foreach_add_(chunk.targets, chunk.sources[pick], alpha=alpha)
    for back, pair in chunk.writebacks:
        back.copy_(pair[pick])
    for bank_params, found_stored in chunk.completes:
        torch._foreach_add_(bank_params, found_stored, alpha=alpha)
