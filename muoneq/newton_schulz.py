"""Finite-step Newton–Schulz orthogonalization, ``NS_K`` of the paper.

The paper (Section 2, Theorem 3.1) writes the iteration for a wide matrix
``G`` (p ≤ q) as

    X_0 = G / ‖G‖_F,      X_{k+1} = (a·I + b·X_k X_kᵀ + c·(X_k X_kᵀ)²) X_k,

so every singular value follows ``s ← φ(s) = a·s + b·s³ + c·s⁵`` while the singular
vectors stay fixed; after enough steps ``X_K`` approaches the polar factor
``Orth(G) = U Vᵀ``. Tall matrices are transposed to wide so that the Gram matrix
``A = X Xᵀ`` is the smaller one.

Coefficient schedules (``ns_coefficients``):

* ``"quintic"`` – (3.4445, −4.7750, 2.0315) every step (Keller Jordan's Muon, the
  paper's NS5); fast, converges to singular values in roughly [0.7, 1.2] rather than 1.
* ``"taylor"`` – (15/8, −5/4, 3/8), the polynomial of the paper's NS5 lemma; the
  classical monotone iteration (φ(s) ≥ s on [0, 1], fixed point 1).
* ``"polar_express"`` – the published per-step tuples of Polar Express
  (Amsel et al., 2025, as used in modded-nanogpt) with the input scaled by
  ``1.02·‖G‖_F``; when more steps than published tuples are asked for, the last
  tuple repeats (it is the tuple tuned for the converged regime).
* an explicit ``(a, b, c)`` used at every step, or a sequence of per-step tuples
  (its length must equal ``ns_steps``).

Evaluation orders (``ns_algorithm``), the same polynomial of ``G`` in exact arithmetic:

* ``"standard"`` – the loop above on the m×n iterate, ``K·(4m²n + 2m³)`` FLOPs, the
  operations and order of ``torch.optim.Muon`` (bit for bit in bf16);
* ``"gram"`` – the iteration carried on the m×m Gram matrix: with ``R_k = X_k X_kᵀ`` and
  ``Z_k = b·R_k + c·R_k²``, ``X_{k+1} = (a·I + Z_k) X_k`` and
  ``R_{k+1} = (a·I + Z_k) R_k (a·I + Z_k)``, so ``X_K = Q X_0`` with
  ``Q = Π_k (a·I + Z_k)`` and the m×n matrix is touched only by ``X_0 X_0ᵀ`` and ``Q X_0``
  (:func:`gram_iterate`). In bf16, errors in ``R`` and ``Q`` compound, so the iteration
  restarts from ``X`` every :data:`GRAM_RESTART` steps and every m×m matrix keeps its
  dominant diagonal in float32. It costs ``4m²n + (8L − 6)m³`` matmul FLOPs per segment of
  ``L`` steps (0.67× at n = 4m, K = 5) plus element-wise passes over the m×m matrices, and is
  used only on matrices where the FLOPs are less than ``"standard"``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

QUINTIC = (3.4445, -4.7750, 2.0315)
TAYLOR = (15 / 8, -5 / 4, 3 / 8)
POLAR_EXPRESS = (
    (8.15655, -22.48329, 15.87877),
    (4.04293, -2.80892, 0.50002),
    (3.89167, -2.77248, 0.50606),
    (3.28575, -2.36813, 0.46449),
    (2.34654, -1.70978, 0.42324),
)
NAMED_COEFFICIENTS = ("quintic", "taylor", "polar_express")
#: An ``ns_coefficients`` value: a name of :data:`NAMED_COEFFICIENTS`, one ``(a, b, c)`` for
#: every step, or one per step.
Coefficients = str | tuple[float, float, float] | Sequence[tuple[float, float, float]]
NS_ALGORITHMS = ("standard", "gram")

#: Steps carried in Gram space before restarting from the m×n iterate. Measured against a
#: float64 NS5 (bf16, quintic, m = 64…768, n = 3m…9m), as a ratio to the ``"standard"`` order's
#: error: without restarts the Gram order is 6–24× less accurate on spectra decaying to 1e-3;
#: restarting every 3 steps, with every m×m matrix's diagonal in float32, it is 0.3–0.6× on
#: Gaussian inputs, 0.95–1.05× on decaying ones and 0.5–0.85× when the columns span 100× in
#: scale (with only ``Q``'s diagonal in float32: 1.1–1.5×, up to 1.65×).
GRAM_RESTART = 3

#: Lower clamp of the Frobenius norm before dividing (as torch.optim.Muon does), so that a zero
#: matrix maps to zero instead of NaN.
NORM_EPS = 1e-7

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class NSSchedule:
    """Resolved per-step coefficients plus the safety factor applied to ``‖G‖_F``."""

    coefficients: tuple[tuple[float, float, float], ...]
    norm_scale: float = 1.0

    @property
    def steps(self) -> int:
        return len(self.coefficients)


def _as_triple(x, what: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(v) for v in x)
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients: {what} must be three numbers (a, b, c), got {x!r}"
        ) from None
    return (a, b, c)


def normalize_coefficients(spec, ns_steps: int):
    """Validate an ``ns_coefficients`` value against ``ns_steps``; return a hashable form.

    Returns a lower-case name, a single ``(a, b, c)`` tuple, or a tuple of per-step tuples.
    """
    if isinstance(spec, str):
        name = spec.lower()
        if name not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown name {spec!r}; allowed: "
                f"{', '.join(NAMED_COEFFICIENTS)}, an explicit (a, b, c) or a list of ns_steps "
                "such tuples"
            )
        return name
    if not isinstance(spec, Sequence) or len(spec) == 0:
        raise ValueError(
            f"ns_coefficients: expected a name ({', '.join(NAMED_COEFFICIENTS)}), an (a, b, c) "
            f"tuple or a list of per-step tuples, got {spec!r}"
        )
    if all(isinstance(v, (int, float)) for v in spec):
        return _as_triple(spec, "an explicit tuple")
    per_step = tuple(_as_triple(t, f"step {i}") for i, t in enumerate(spec))
    if len(per_step) != ns_steps:
        raise ValueError(
            f"ns_coefficients: a per-step list must have exactly ns_steps={ns_steps} tuples, "
            f"got {len(per_step)}"
        )
    return per_step


@lru_cache(maxsize=64)
def resolve_schedule(spec, ns_steps: int) -> NSSchedule:
    """Turn a normalized ``ns_coefficients`` value into the per-step coefficient list."""
    spec = normalize_coefficients(spec, ns_steps)
    if spec == "quintic":
        return NSSchedule((QUINTIC,) * ns_steps)
    if spec == "taylor":
        return NSSchedule((TAYLOR,) * ns_steps)
    if spec == "polar_express":
        extra = max(0, ns_steps - len(POLAR_EXPRESS))
        steps = POLAR_EXPRESS[:ns_steps] + (POLAR_EXPRESS[-1],) * extra
        return NSSchedule(steps, norm_scale=1.02)
    if isinstance(spec[0], float):
        return NSSchedule((spec,) * ns_steps)
    return NSSchedule(spec)


#: ``ns_dtype="auto"``: bfloat16 on accelerators (CUDA, NPU, …), the paper's setting, and on a
#: CPU whose matrix units multiply bf16 natively (:func:`cpu_has_native_bf16`: there a bf16
#: matmul runs at twice float32's rate); float32 on other CPUs, which emulate bf16 products
#: (~40× slower than float32) — and float32 is the more accurate.
AUTO_DTYPE = "auto"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 or AMX tiles, as torch's CPU
    probes report them (``torch.backends.cpu.get_cpu_capability()`` names the vector width
    only: ``"AVX512"`` with or without them)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, bool)() for probe in probes)


def dtype_name(dtype) -> str:
    """The canonical name (``"auto"``, ``"bfloat16"``, …) of an allowed ``ns_dtype``.

    Param groups keep the name, not the ``torch.dtype``: ``torch.distributed.checkpoint``
    refuses dtype objects in an optimizer state dict (FSDP2 checkpoints).
    """
    if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE:
        return AUTO_DTYPE
    resolved = resolve_dtype(dtype, allow_auto=True)
    return next(name for name, value in DTYPES.items() if value is resolved)


def resolve_dtype(dtype, device: torch.device | str | None = None, *,
                  allow_auto: bool | None = None) -> torch.dtype:
    """Accept a ``torch.dtype`` or its name (``"bfloat16"``, ``"float32"``, …); ``"auto"`` is
    bfloat16 on an accelerator ``device`` and on a CPU with native bf16 products, float32 on
    other CPUs (:data:`AUTO_DTYPE`; it needs the ``device``)."""
    allow_auto = device is not None if allow_auto is None else allow_auto
    allowed = ", ".join([AUTO_DTYPE, *DTYPES] if allow_auto else DTYPES)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"ns_dtype: {dtype} is not allowed; allowed: {allowed}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE and device is not None:
        cpu = torch.device(device).type == "cpu"
        return torch.float32 if cpu and not cpu_has_native_bf16() else torch.bfloat16
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"ns_dtype: unknown dtype {dtype!r}; allowed: {allowed}")


def canonical_algorithm(name) -> str:
    """Validate an ``ns_algorithm`` value (case-insensitive)."""
    if isinstance(name, str) and name.lower() in NS_ALGORITHMS:
        return name.lower()
    raise ValueError(
        f"ns_algorithm: unknown value {name!r}; allowed: {', '.join(NS_ALGORITHMS)}"
    )


def ns_flops(shape: Sequence[int], steps: int, algorithm: str = "standard") -> float:
    """Matmul FLOPs of ``steps`` Newton–Schulz iterations on an m×n matrix (either orientation).

    With ``algorithm="gram"`` this is the cost of the cheaper of the two orders (the one
    :func:`run_schedule` picks).
    """
    m, n = sorted(shape[-2:])
    standard = steps * (4.0 * m * m * n + 2.0 * m**3)
    if algorithm == "standard":
        return standard
    segments = [min(GRAM_RESTART, steps - s) for s in range(0, steps, GRAM_RESTART)]
    return min(standard, sum(4.0 * m * m * n + (8 * L - 6) * m**3 for L in segments))


def newton_schulz_step(X: Tensor, a: float, b: float, c: float, *, out: Tensor | None = None,
                       gram: Tensor | None = None, poly: Tensor | None = None) -> Tensor:
    """One step ``X ← (a·I + b·A + c·A²)·X`` with ``A = X Xᵀ``, for a wide ``X`` or a stack.

    The operations and order of ``torch.optim.Muon`` (``addmm``; ``baddbmm`` for stacks), so
    that the two agree bit for bit. ``out``, ``gram`` and ``poly`` are optional buffers for the
    new ``X``, ``A`` and ``b·A + c·A²`` (the optimizer's workspace reuses them between steps).
    """
    A = torch.matmul(X, X.mT, out=gram)
    B = _addmm(A, A, A, beta=b, alpha=c, out=poly)
    return _addmm(X, B, X, beta=a, out=out)


def iterate_stack(X: Tensor, coefficients, *, other: Tensor, gram: Tensor,
                  poly: Tensor) -> Tensor:
    """Newton–Schulz steps on a normalized stack ``X`` ``(k, m, n)``, three batched products
    per step, in persistent buffers: the iterate alternates between ``X`` and ``other``, the
    ``(k, s, s)`` Gram matrix and polynomial (``s = min(m, n)``) live in ``gram`` and ``poly``.

    Tall matrices stay tall: ``A = XᵀX`` and ``X ← a·X + X·B`` are the wide iteration of
    ``Xᵀ`` transposed, with no transposed copy. Returns the buffer holding the last iterate.
    """
    tall = X.size(-2) > X.size(-1)
    (current, current_t), (following, following_t) = ((X, X.mT), (other, other.mT))
    for a, b, c in coefficients:
        if tall:
            torch.bmm(current_t, current, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
            torch.baddbmm(current, current, poly, beta=a, out=following)
        else:
            torch.bmm(current, current_t, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
            torch.baddbmm(current, poly, current, beta=a, out=following)
        (current, current_t), (following, following_t) = ((following, following_t),
                                                          (current, current_t))
    return current


def _addmm(C: Tensor, A: Tensor, B: Tensor, *, beta: float, alpha: float = 1.0,
           out: Tensor | None = None) -> Tensor:
    """``beta·C + alpha·(A @ B)``: ``addmm`` for matrices, ``baddbmm`` for stacks."""
    if C.ndim == 2:
        return torch.addmm(C, A, B, beta=beta, alpha=alpha, out=out)
    if C.ndim == 3:
        return torch.baddbmm(C, A, B, beta=beta, alpha=alpha, out=out)
    return torch.add(beta * C, A @ B, alpha=alpha, out=out)


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients="quintic",
    dtype: torch.dtype | str = AUTO_DTYPE,
    algorithm: str = "standard",
) -> Tensor:
    """Return ``NS_K(G)`` for a matrix or a batch of matrices ``(..., m, n)``.

    The result has ``G``'s shape and is computed in ``dtype`` (a ``torch.dtype``, its name, or
    ``"auto"``: :data:`AUTO_DTYPE`, for ``G``'s device; returned in that dtype: callers cast
    when applying the update). ``steps=0`` returns the normalized input. ``algorithm`` is the
    evaluation order (module docstring).
    """
    if G.ndim < 2:
        raise ValueError(
            f"newton_schulz: expected a matrix (..., m, n), got shape {tuple(G.shape)}"
        )
    return orthogonalizer(steps, coefficients, dtype, algorithm, device=G.device)(G)


def orthogonalizer(steps: int = 5, coefficients="quintic", dtype: torch.dtype | str = AUTO_DTYPE,
                   algorithm: str = "standard", *, device: torch.device | str | None = None,
                   run: Callable[..., Tensor] | None = None,
                   backend: str | Callable = "torch") -> Callable[..., Tensor]:
    """``NS_K`` with its settings validated once: ``orthogonalize(G, workspace=None)`` is
    :func:`run_schedule` (or ``run``, e.g. its ``torch.compile``'d form) with the resolved
    schedule, dtype (``"auto"`` for ``device``), evaluation order and backend (one matrix at
    a time, ``"auto"`` is ``"torch"``). The one entry to Newton–Schulz of :func:`newton_schulz`
    and of every optimizer here (once per param group, not per matrix)."""
    schedule = resolve_schedule(normalize_coefficients(coefficients, steps), steps)
    backend = canonical_backend(backend)
    return functools.partial(run or run_schedule, schedule=schedule,
                             dtype=resolve_dtype(dtype, device),
                             algorithm=canonical_algorithm(algorithm),
                             iterate=None if backend in ("torch", "auto") else
                             backend_iteration(backend))


def run_schedule(G: Tensor, schedule: NSSchedule, dtype: torch.dtype, *,
                 workspace: Workspace | None = None, algorithm: str = "standard",
                 iterate: Callable[..., Tensor] | None = None) -> Tensor:
    """The iteration of :func:`newton_schulz` for a resolved schedule (no validation).

    Free of Python-side caches, so ``torch.compile`` can trace it (``MuonEq(compile=True)``).
    With a ``workspace`` a matrix is iterated in its reused buffers (``G`` itself is normalized
    in place when it already has ``dtype``): the result is valid until the workspace's next
    Newton–Schulz call. ``algorithm="gram"`` switches to :func:`gram_iterate` where that needs
    fewer FLOPs (canonical name expected); otherwise ``iterate`` (a backend's stacked iteration,
    :func:`backend_iteration`) runs the steps, or, by default, torch.optim.Muon's operations.
    """
    X, transposed = _normalized_wide(G, dtype, schedule.norm_scale, in_place=workspace is not None)
    steps = schedule.steps
    if algorithm == "gram" and ns_flops(X.shape, steps, "gram") < ns_flops(X.shape, steps):
        X = gram_iterate(X, schedule.coefficients, workspace)
    elif iterate is not None:
        X = _iterate_as_stack(X, schedule.coefficients, iterate, workspace)
    else:
        buffers = workspace is not None and X.ndim == 2
        for k, (a, b, c) in enumerate(schedule.coefficients):
            X = newton_schulz_step(X, a, b, c, **(_buffers(workspace, X, k) if buffers else {}))
    return X.mT if transposed else X


def _iterate_as_stack(X: Tensor, coefficients, iterate: Callable[..., Tensor],
                      workspace: Workspace | None) -> Tensor:
    """A backend's stacked iteration on a normalized matrix or batch ``X`` (as one stack)."""
    stack = X.reshape(-1, *X.shape[-2:])
    small = min(stack.shape[-2:])
    shapes = {"ns_x1": stack.shape, "ns_gram": (stack.shape[0], small, small),
              "ns_poly": (stack.shape[0], small, small)}
    buffers = {name: torch.empty(shape, dtype=X.dtype, device=X.device) if workspace is None
               else workspace.take(name, shape, X.dtype, X.device)
               for name, shape in shapes.items()}
    found = iterate(stack, coefficients, other=buffers["ns_x1"], gram=buffers["ns_gram"],
                    poly=buffers["ns_poly"])
    return found.reshape(X.shape)


#: ``ns_backend``: who runs the Newton–Schulz products. ``"torch"``: batched torch matmuls
#: (torch.optim.Muon's operations one matrix at a time); ``"triton"``: this project's kernels
#: (:mod:`muoneq.ns_triton`: symmetric products computed as one triangle, the polynomial and
#: its application fused); ``"auto"``: on a GPU, per stack shape, whichever of the two a one-off
#: timing finds faster (Triton only when it also agrees with torch), torch elsewhere. A callable
#: ``backend(X, coefficients) -> Tensor`` runs them itself: ``X`` a normalized stack
#: ``(k, m, n)`` in the NS dtype (wide or tall), ``coefficients`` the per-step ``(a, b, c)``;
#: it returns the last iterate, of ``X``'s shape.
NS_BACKENDS = ("torch", "triton", "auto")
#: An ``ns_backend`` value: a name of :data:`NS_BACKENDS` or a callable backend.
Backend = str | Callable[[Tensor, tuple[tuple[float, float, float], ...]], Tensor]


def canonical_backend(backend):
    """Validate an ``ns_backend`` value: a name of :data:`NS_BACKENDS` (case-insensitive) or a
    callable."""
    if callable(backend):
        return backend
    if isinstance(backend, str) and backend.lower() in NS_BACKENDS:
        return backend.lower()
    raise ValueError(
        f"ns_backend: unknown value {backend!r}; allowed: {', '.join(NS_BACKENDS)}, or a "
        "callable backend(X, coefficients) -> Tensor"
    )


def backend_iteration(backend) -> Callable[..., Tensor]:
    """The stacked iteration of a backend other than ``"auto"``, with the signature of
    :func:`iterate_stack` (``iterate(X, coefficients, *, other, gram, poly)``)."""
    if backend == "torch":
        return iterate_stack
    if backend == "triton":
        from muoneq import ns_triton

        return ns_triton.iterate_stack

    def iterate(X: Tensor, coefficients, **buffers) -> Tensor:
        found = backend(X, coefficients)
        if not isinstance(found, Tensor) or found.shape != X.shape:
            raise ValueError(
                f"ns_backend: the callable returned "
                f"{tuple(found.shape) if isinstance(found, Tensor) else type(found).__name__}"
                f" for a stack of shape {tuple(X.shape)}; it must return the last iterate, "
                "of the same shape"
            )
        return found

    return iterate


def fastest_iteration(candidates: dict[str, Callable[..., Tensor]], X: Tensor, coefficients, *,
                      other: Tensor, gram: Tensor, poly: Tensor, repeats: int = 5,
                      time_of: Callable[[Callable[[], object]], float] | None = None) -> str:
    """``ns_backend="auto"`` on one stack shape: the name of the candidate whose iteration of a
    random normalized stack in ``X``'s buffers is fastest (median of ``repeats`` timings after a
    warm-up) among those that agree with ``candidates["torch"]`` (relative difference at most
    :data:`AGREEMENT` of the dtype); ties go to ``"torch"``, which is never slower than itself.
    ``time_of(run)`` times one run (default: wall clock, device synchronized)."""
    time_of = time_of or _wall_time
    gen = torch.Generator(device=X.device).manual_seed(0)
    probe = torch.randn(X.shape, generator=gen, device=X.device, dtype=torch.float32)
    probe /= probe.norm(dim=(-2, -1), keepdim=True)
    buffers = {"other": other, "gram": gram, "poly": poly}

    def run(fn: Callable[..., Tensor]) -> Tensor:
        X.copy_(probe)
        return fn(X, coefficients, **buffers)

    def timed(fn: Callable[..., Tensor]) -> float:
        return sorted(time_of(lambda: run(fn)) for _ in range(repeats))[repeats // 2]

    reference = run(candidates["torch"]).float().clone()  # also the warm-up
    best, best_time = "torch", timed(candidates["torch"])
    for name, fn in candidates.items():
        if name == "torch":
            continue
        found = run(fn).float()  # the warm-up (compilation, caches), and its agreement
        if (found - reference).norm() > AGREEMENT[X.dtype] * reference.norm():
            continue
        elapsed = timed(fn)
        if elapsed < best_time:
            best, best_time = name, elapsed
    return best


#: The most two backends' Newton–Schulz results may differ (relative Frobenius distance) and
#: still count as the same computation in that dtype: a few units of its rounding, amplified
#: by the iteration (broken kernels differ by order 1).
AGREEMENT = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4,
             torch.float64: 1e-10}


def _wall_time(fn: Callable[[], object]) -> float:
    device_sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    device_sync()
    start = time.perf_counter()
    fn()
    device_sync()
    return time.perf_counter() - start


def newton_schulz_iterates(
    G: Tensor,
    steps: int = 5,
    coefficients="quintic",
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[Tensor]:
    """Yield every iterate ``X_0, X_1, …, X_K`` of :func:`newton_schulz`, in ``G``'s orientation.

    One pass records the whole error curve of Theorem 3.1 (the spectral diagnostics use
    it); it performs the same operations in the same order as :func:`newton_schulz`, so the
    last iterate equals ``newton_schulz(G, steps, coefficients, dtype)`` bit for bit.
    """
    if G.ndim < 2:
        raise ValueError(
            f"newton_schulz_iterates: expected a matrix (..., m, n), got shape {tuple(G.shape)}"
        )
    schedule = resolve_schedule(normalize_coefficients(coefficients, steps), steps)
    X, transposed = _normalized_wide(G, resolve_dtype(dtype, G.device), schedule.norm_scale)
    yield X.mT if transposed else X
    for a, b, c in schedule.coefficients:
        X = newton_schulz_step(X, a, b, c)
        yield X.mT if transposed else X


def _normalized_wide(G: Tensor, dtype: torch.dtype, norm_scale: float,
                     in_place: bool = False) -> tuple[Tensor, bool]:
    """``X_0 = G/‖G‖_F`` in ``dtype`` (the norm times the schedule's safety factor, clamped at
    :data:`NORM_EPS` as torch.optim.Muon does), tall matrices transposed to wide; ``in_place``
    divides ``G`` itself when it already has ``dtype``."""
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    scale = (X.norm(dim=(-2, -1), keepdim=True) * norm_scale).clamp(min=NORM_EPS)
    return (X.div_(scale) if in_place else X / scale), transposed


def _buffers(workspace: Workspace, X: Tensor, k: int) -> dict[str, Tensor]:
    """Step ``k``'s buffers for a wide matrix ``X``: the iterate alternates between two."""
    m, n = X.shape
    take = functools.partial(workspace.take, dtype=X.dtype, device=X.device)
    return {"gram": take("ns_gram", (m, m)), "poly": take("ns_poly", (m, m)),
            "out": take(f"ns_x{k % 2}", (m, n))}


def gram_iterate(X: Tensor, coefficients, workspace: Workspace | None = None) -> Tensor:
    """Newton–Schulz steps on a normalized wide ``X`` (..., m ≤ n) carried in Gram space.

    Per segment of at most :data:`GRAM_RESTART` steps: ``R = X Xᵀ``; each step forms
    ``P = a·I + b·R + c·R²``, multiplies ``Q ← Q P`` (all factors are polynomials in the
    segment's first ``R``, so they commute) and, unless it is the segment's last,
    ``R ← P R P``; the segment ends with ``X ← Q X``. Every m×m matrix is held *split*: its
    diagonal in float32, its off-diagonal part in ``X``'s dtype. The diagonal dominates these
    matrices, and rounding it to bf16 at every product is what made the plain Gram order less
    accurate than the standard one; split, it is more accurate (:data:`GRAM_RESTART`). The
    products cost the same matmuls plus a few element-wise passes. With a ``workspace`` every
    temporary lives in its reused buffers.
    """
    shape = X.shape
    if X.ndim > 3:
        X = X.reshape(-1, *shape[-2:])
    square, diag_shape = (*X.shape[:-1], X.size(-2)), X.shape[:-1]
    acc = torch.promote_types(X.dtype, torch.float32)

    def take(name: str, size, dtype: torch.dtype = X.dtype) -> Tensor:
        if workspace is None:
            return torch.empty(size, dtype=dtype, device=X.device)
        return workspace.take(name, size, dtype, X.device)

    def split(name: str) -> tuple[Tensor, Tensor]:
        return take(f"gram_{name}_diag", diag_shape, acc), take(f"gram_{name}_off", square)

    full = take("gram_full", square, acc)  # one product, whole, in float32

    def product(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor:
        """``full ← (diag(a₀) + a₁)(diag(b₀) + b₁)``."""
        full.copy_(torch.matmul(a[1], b[1], out=take("gram_mm", square)))
        full.addcmul_(a[0].unsqueeze(-1), b[1]).addcmul_(a[1], b[0].unsqueeze(-2))
        _diagonal(full).addcmul_(a[0], b[0])
        return full

    def store(into: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Split ``full`` into ``into`` (diagonal, off-diagonal part)."""
        into[0].copy_(_diagonal(full))
        _diagonal(full).zero_()
        into[1].copy_(full)
        return into

    for s, start in enumerate(range(0, len(coefficients), GRAM_RESTART)):
        segment = coefficients[start : start + GRAM_RESTART]
        R = split("r")
        torch.matmul(X, X.mT, out=R[1])
        torch.linalg.vector_norm(X, dim=-1, dtype=acc, out=R[0]).square_()
        _diagonal(R[1]).zero_()
        Q = split("q")
        for j, (a, b, c) in enumerate(segment):
            product(R, R).mul_(c).add_(R[1], alpha=b)  # Z = b·R + c·R²
            _diagonal(full).add_(R[0], alpha=b).add_(a)  # P = a·I + Z
            P = store(Q if j == 0 else split("p"))  # the segment's first P is its Q
            if j > 0:  # Q ← Q P
                product(Q, P)
                store(Q)
            if j + 1 < len(segment):  # R ← P (R P)
                product(R, P)
                product(P, store(split("t")))
                store(R)
        out = torch.matmul(Q[1], X, out=take(f"gram_x{s % 2}", X.shape))
        X = out.addcmul_(Q[0].unsqueeze(-1), X)
    return X.reshape(shape)


def _diagonal(t: Tensor) -> Tensor:
    return t.diagonal(dim1=-2, dim2=-1)


class Workspace:
    """Scratch tensors reused from matrix to matrix and from step to step.

    One flat buffer per name and dtype, grown to the largest request and viewed with the
    requested shape, so it holds as much as one matrix's temporaries. On CPU, allocating and
    first touching fresh multi-megabyte tensors for every matrix costs about as much as the
    element-wise work on them. A tensor taken under a name is valid until that name is taken
    again.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple, Tensor] = {}
        self._reserved: dict[tuple, int] = {}

    def reserve(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> None:
        """Announce a later :meth:`take`: the first take of ``name`` allocates the largest size
        reserved, so that views taken one after another stay views of one buffer."""
        key = (name, dtype, torch.device(device))
        self._reserved[key] = max(self._reserved.get(key, 0), math.prod(shape))

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        key, size = (name, dtype, torch.device(device)), math.prod(shape)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < size:
            size_now = max(size, self._reserved.get(key, 0))
            flat = self._flat[key] = torch.empty(size_now, dtype=dtype, device=device)
        return flat[:size].view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes the reservations will take once taken (one buffer per name and dtype)."""
        return sum(size * dtype.itemsize for (_, dtype, _), size in self._reserved.items())
