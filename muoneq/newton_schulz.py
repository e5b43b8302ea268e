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
    :func:`iteration_for` picks).
    """
    m, n = sorted(shape[-2:])
    standard = steps * (4.0 * m * m * n + 2.0 * m**3)
    if algorithm == "standard":
        return standard
    segments = [min(GRAM_RESTART, steps - s) for s in range(0, steps, GRAM_RESTART)]
    return min(standard, sum(4.0 * m * m * n + (8 * L - 6) * m**3 for L in segments))


#: A buffer an iteration asks for: ``(name, shape, dtype)`` (the plan reserves it once).
Request = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class NSSettings:
    """A group's Newton–Schulz (line 12) as the step runs it: the resolved schedule, the dtype,
    the evaluation order (``ns_algorithm``) and who runs the products (``ns_backend``)."""

    schedule: NSSchedule
    dtype: torch.dtype
    algorithm: str = "standard"
    backend: str | Callable = "torch"


def ns_settings(steps: int, coefficients, dtype, algorithm: str = "standard",
                backend="torch", *, device: torch.device | str | None = None) -> NSSettings:
    """:class:`NSSettings` of a group's ``ns_steps``, ``ns_coefficients``, ``ns_dtype`` (``"auto"``
    for ``device``), ``ns_algorithm`` and ``ns_backend``, validated."""
    algorithm, backend = canonical_algorithm(algorithm), canonical_backend(backend)
    check_runs(algorithm, backend)
    return NSSettings(resolve_schedule(normalize_coefficients(coefficients, steps), steps),
                      resolve_dtype(dtype, device), algorithm, backend)


def check_runs(algorithm: str, backend: Backend) -> None:
    """Refuse, in one line, an ``ns_algorithm`` the ``ns_backend`` cannot run: the Gram order
    runs on torch's products only (``"auto"`` keeps it where the FLOP rule chooses it)."""
    if algorithm == "gram" and backend not in ("torch", "auto"):
        name = getattr(backend, "__name__", repr(backend))
        raise ValueError(f"ns_algorithm: 'gram' runs on torch's products; ns_backend={name} "
                         "runs the standard order only (use ns_algorithm='standard' or "
                         "ns_backend='torch')")


def normalize(X: Tensor, norm_scale: float = 1.0, *, norm: Tensor | None = None) -> Tensor:
    """``X ← X / max(s·‖X‖_F, ε)`` for each matrix of ``X`` (``..., m, n``), in place: the input
    scaling of every iteration here (``s``: the schedule's safety factor; ``ε``:
    :data:`NORM_EPS`, as torch.optim.Muon clamps), the norm in ``X``'s dtype into ``norm``."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, out=norm)
    if norm_scale != 1:
        norm.mul_(norm_scale)
    return X.div_(norm.clamp_(min=NORM_EPS))


def newton_schulz_step(X: Tensor, a: float, b: float, c: float, *, Xt: Tensor | None = None,
                       out: Tensor | None = None, gram: Tensor | None = None,
                       poly: Tensor | None = None) -> Tensor:
    """One step of ``NS_K`` on a matrix or a stack, the Gram matrix ``A`` on the smaller side:
    wide ``X``: ``A = X Xᵀ``, ``X ← a·X + (b·A + c·A²)·X``; tall: ``A = Xᵀ X``,
    ``X ← a·X + X·(b·A + c·A²)`` (the wide step of ``Xᵀ``, transposed, with no transposed copy).

    On a wide matrix these are torch.optim.Muon's operations in its order (``addmm``), so the two
    agree bit for bit; a stack runs them batched (``bmm``, ``baddbmm``). ``Xt`` is ``X.mT`` when
    the caller holds it; ``out``, ``gram``, ``poly`` take the new ``X``, ``A`` and
    ``b·A + c·A²``."""
    Xt = X.mT if Xt is None else Xt
    matmul = torch.mm if X.ndim == 2 else torch.bmm  # no reshaping around them
    if X.size(-2) > X.size(-1):
        A = matmul(Xt, X, out=gram)
        B = _addmm(A, A, A, beta=b, alpha=c, out=poly)
        return _addmm(X, X, B, beta=a, out=out)
    A = matmul(X, Xt, out=gram)
    B = _addmm(A, A, A, beta=b, alpha=c, out=poly)
    return _addmm(X, B, X, beta=a, out=out)


def _addmm(C: Tensor, A: Tensor, B: Tensor, *, beta: float, alpha: float = 1.0,
           out: Tensor | None = None) -> Tensor:
    """``beta·C + alpha·(A @ B)``: ``addmm`` for matrices, ``baddbmm`` for stacks."""
    if C.ndim == 2:
        return torch.addmm(C, A, B, beta=beta, alpha=alpha, out=out)
    return torch.baddbmm(C, A, B, beta=beta, alpha=alpha, out=out)


# ----------------------------------------------------------------------------- the backends
# Every iteration takes a normalized stack ``X`` (k, m, n) in the NS dtype, the per-step
# coefficients and the buffers it asked for (:meth:`requests`, reserved once by the plan), and
# returns the last iterate, of ``X``'s shape (it may be ``X`` or one of the buffers).
class StackIteration:
    """``ns_backend="torch"`` on a stack: three batched products per step
    (:func:`newton_schulz_step`), the iterate alternating between ``X`` and ``ns_other``, the
    ``(k, s, s)`` Gram matrix and polynomial (``s = min(m, n)``) in ``ns_gram``, ``ns_poly``."""

    name = "torch"

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype) -> list[Request]:
        small = min(shape)
        return [("ns_other", (count, *shape), dtype), ("ns_gram", (count, small, small), dtype),
                ("ns_poly", (count, small, small), dtype)]

    def iterate(self, X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
        other, gram, poly = buffers["ns_other"], buffers["ns_gram"], buffers["ns_poly"]
        (current, current_t), (following, following_t) = (X, X.mT), (other, other.mT)
        for a, b, c in coefficients:
            newton_schulz_step(current, a, b, c, Xt=current_t, out=following, gram=gram,
                               poly=poly)
            (current, current_t), (following, following_t) = ((following, following_t),
                                                              (current, current_t))
        return current


class MatrixIteration:
    """``ns_backend="torch"`` one matrix at a time, in torch.optim.Muon's operations and order
    (``batching="per_matrix"``: where our Muon is torch.optim.Muon bit for bit): a tall matrix is
    iterated as its (strided) wide view, the iterate then alternating between ``ns_other`` and
    ``X``'s own storage, both wide."""

    name = "torch"

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype) -> list[Request]:
        small, large = sorted(shape)
        return [("ns_other", (count, small, large), dtype),
                ("ns_gram", (count, small, small), dtype),
                ("ns_poly", (count, small, small), dtype)]

    def iterate(self, X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
        tall = X.size(-2) > X.size(-1)
        wide = X.mT if tall else X
        current, following = wide, buffers["ns_other"]
        for k, (a, b, c) in enumerate(coefficients):
            for j in range(X.size(0)):
                newton_schulz_step(current[j], a, b, c, out=following[j],
                                   gram=buffers["ns_gram"][j], poly=buffers["ns_poly"][j])
            if k == 0:  # X's storage is free after the first step: the next wide buffer
                current, following = following, (wide if wide.is_contiguous()
                                                  else X.view(following.shape))
            else:
                current, following = following, current
        return current.mT if tall else current


class GramIteration:
    """``ns_algorithm="gram"``: the same polynomial carried on the small Gram matrix
    (:func:`gram_iterate`), for the shapes where :func:`ns_flops` says it is cheaper; a tall
    stack is iterated as its wide view."""

    name = "torch"

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype) -> list[Request]:
        small, large = sorted(shape)
        square, diagonal = (count, small, small), (count, small)
        accumulate = torch.promote_types(dtype, torch.float32)
        split = [(f"gram_{name}_{part}", diagonal if part == "diag" else square,
                  accumulate if part == "diag" else dtype)
                 for name in ("r", "q", "p", "t") for part in ("diag", "off")]
        return [*split, ("gram_full", square, accumulate), ("gram_mm", square, dtype),
                ("gram_x0", (count, small, large), dtype),
                ("gram_x1", (count, small, large), dtype)]

    def iterate(self, X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
        tall = X.size(-2) > X.size(-1)
        found = gram_iterate(X.mT if tall else X, coefficients, buffers)
        return found.mT if tall else found


class CallableIteration:
    """A callable ``ns_backend``: ``backend(X, coefficients)`` runs the steps itself and returns
    the last iterate, of ``X``'s shape (checked)."""

    def __init__(self, backend: Callable[[Tensor, tuple], Tensor]):
        self.backend = backend
        self.name = getattr(backend, "__name__", "callable")

    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype) -> list[Request]:
        return []

    def iterate(self, X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
        found = self.backend(X, coefficients)
        if not isinstance(found, Tensor) or found.shape != X.shape:
            raise ValueError(
                f"ns_backend: the callable returned "
                f"{tuple(found.shape) if isinstance(found, Tensor) else type(found).__name__}"
                f" for a stack of shape {tuple(X.shape)}; it must return the last iterate, "
                "of the same shape"
            )
        return found


class TritonIteration(StackIteration):
    """``ns_backend="triton"``: :func:`muoneq.ns_triton.iterate_stack`, in the torch backend's
    buffers."""

    name = "triton"

    def iterate(self, X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
        from muoneq import ns_triton

        return ns_triton.iterate_stack(X, coefficients, other=buffers["ns_other"],
                                       gram=buffers["ns_gram"], poly=buffers["ns_poly"])


#: The interface every iteration above has (``requests``, ``iterate``, ``name``).
Iteration = StackIteration | MatrixIteration | GramIteration | CallableIteration


def iteration_for(settings: NSSettings, shape: tuple[int, int], *, per_matrix: bool = False
                  ) -> Iteration:
    """The iteration a stack of ``shape`` matrices runs (the one seam of Newton–Schulz): the
    Gram order where ``ns_algorithm="gram"`` and :func:`ns_flops` finds it cheaper, else the
    group's backend — torch's batched products, or one matrix at a time in torch.optim.Muon's
    order (``per_matrix``), Triton's kernels, a callable. ``"auto"`` here is torch's (the plan
    times the candidates on a GPU: :func:`fastest_iteration`)."""
    steps = settings.schedule.steps
    backend = settings.backend
    if settings.algorithm == "gram" and ns_flops(shape, steps, "gram") < ns_flops(shape, steps):
        return GramIteration()
    if callable(backend):
        return CallableIteration(backend)
    if backend == "triton":
        return TritonIteration()
    return MatrixIteration() if per_matrix else StackIteration()


def buffers_for(iteration: Iteration, X: Tensor) -> dict[str, Tensor]:
    """Freshly allocated buffers of ``iteration`` for the stack ``X`` (outside a plan)."""
    return {name: torch.empty(shape, dtype=dtype, device=X.device)
            for name, shape, dtype in iteration.requests(X.size(0), tuple(X.shape[-2:]),
                                                         X.dtype)}


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients="quintic",
    dtype: torch.dtype | str = AUTO_DTYPE,
    algorithm: str = "standard",
    backend: Backend = "torch",
) -> Tensor:
    """Return ``NS_K(G)`` for a matrix or a batch of matrices ``(..., m, n)``.

    The result has ``G``'s shape and is computed in ``dtype`` (a ``torch.dtype``, its name, or
    ``"auto"``: :data:`AUTO_DTYPE`, for ``G``'s device; returned in that dtype: callers cast
    when applying the update), matrix by matrix in torch.optim.Muon's operations
    (:class:`MatrixIteration`; the Gram order: :class:`GramIteration`). ``steps=0`` returns
    the normalized input. ``algorithm`` is the evaluation order (module docstring);
    ``backend`` who runs the products (:data:`NS_BACKENDS`; ``"triton"`` and a callable take
    the batch as one stack; ``"auto"`` is ``"torch"`` here).
    """
    if G.ndim < 2:
        raise ValueError(
            f"newton_schulz: expected a matrix (..., m, n), got shape {tuple(G.shape)}"
        )
    settings = ns_settings(steps, coefficients, dtype, algorithm, backend, device=G.device)
    X = _normalized_stack(G, settings)
    iteration = iteration_for(settings, tuple(X.shape[-2:]), per_matrix=True)
    found = iteration.iterate(X, settings.schedule.coefficients, buffers_for(iteration, X))
    return found.reshape(G.shape)


def newton_schulz_iterates(
    G: Tensor,
    steps: int = 5,
    coefficients="quintic",
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[Tensor]:
    """Yield every iterate ``X_0, X_1, …, X_K`` of :func:`newton_schulz`, in ``G``'s orientation.

    One pass records the whole error curve of Theorem 3.1 (the spectral diagnostics use
    it): :class:`MatrixIteration`, one step at a time (the same operations on the same
    values), so the last equals ``newton_schulz(G, steps, coefficients, dtype)`` bit for bit.
    """
    if G.ndim < 2:
        raise ValueError(
            f"newton_schulz_iterates: expected a matrix (..., m, n), got shape {tuple(G.shape)}"
        )
    settings = ns_settings(steps, coefficients, dtype, device=G.device)
    X = _normalized_stack(G, settings)
    yield X.clone().reshape(G.shape)
    iteration = MatrixIteration()
    for coefficients in settings.schedule.coefficients:
        X = iteration.iterate(X, (coefficients,), buffers_for(iteration, X))
        yield X.clone().reshape(G.shape)


def _normalized_stack(G: Tensor, settings: NSSettings) -> Tensor:
    """``X_0``: a copy of ``G`` in the NS dtype as a stack ``(k, m, n)``, scaled by
    :func:`normalize`."""
    X = G.to(settings.dtype, copy=True).reshape(-1, *G.shape[-2:])
    return normalize(X, settings.schedule.norm_scale)


#: ``ns_backend``: who runs the Newton–Schulz products. ``"torch"``: batched torch matmuls
#: (torch.optim.Muon's operations one matrix at a time with ``batching="per_matrix"``);
#: ``"triton"``: this project's kernels (:mod:`muoneq.ns_triton`: symmetric products computed as
#: one triangle, the polynomial and its application fused); ``"auto"``: on a GPU, per stack
#: shape, whichever of the two a one-off timing finds faster (Triton only when it also agrees
#: with torch), torch elsewhere. A callable ``backend(X, coefficients) -> Tensor`` runs them
#: itself: ``X`` a normalized stack ``(k, m, n)`` in the NS dtype (wide or tall),
#: ``coefficients`` the per-step ``(a, b, c)``; it returns the last iterate, of ``X``'s shape.
#: A backend other than torch runs the standard order only (``ns_algorithm="gram"`` with it is
#: refused).
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


def auto_candidates() -> dict[str, Iteration]:
    """The stacked iterations ``ns_backend="auto"`` times against each other on a GPU
    (:func:`fastest_iteration`): torch's products (the reference) and this project's Triton
    kernels."""
    return {"torch": StackIteration(), "triton": TritonIteration()}


def time_iterations(candidates: dict[str, Iteration], X: Tensor, coefficients,
                    buffers: dict[str, Tensor], *, repeats: int = 5,
                    time_of: Callable[[Callable[[], object]], float] | None = None
                    ) -> dict[str, dict[str, float]]:
    """Each candidate's iteration of one random normalized stack of ``X``'s shape, run in ``X``
    and ``buffers`` (allocated by the caller, before any clock starts): ``seconds``, the median
    of ``repeats`` timings after a warm-up run (a run copies the stack into ``X``, which the
    iteration overwrites, and iterates), and ``distance``, the relative Frobenius distance of
    its result to ``candidates["torch"]``'s. ``time_of(run)`` times one run (default:
    :func:`wall_time` on ``X``'s device)."""
    time_of = time_of or functools.partial(wall_time, device=X.device)
    gen = torch.Generator(device=X.device).manual_seed(0)
    probe = torch.randn(X.shape, generator=gen, device=X.device, dtype=torch.float32)
    probe /= probe.norm(dim=(-2, -1), keepdim=True)

    def run(iteration: Iteration) -> Tensor:
        X.copy_(probe)
        return iteration.iterate(X, coefficients, buffers)

    reference = run(candidates["torch"]).float().clone()
    found = {}
    for name, iteration in candidates.items():
        result = run(iteration).float()  # the warm-up (compilation, caches), and its agreement
        distance = ((result - reference).norm() / reference.norm()).item()
        times = sorted(time_of(functools.partial(run, iteration)) for _ in range(repeats))
        found[name] = {"seconds": times[repeats // 2], "distance": distance}
    return found


def fastest_iteration(candidates: dict[str, Iteration], X: Tensor, coefficients,
                      buffers: dict[str, Tensor], *, repeats: int = 5,
                      time_of: Callable[[Callable[[], object]], float] | None = None) -> str:
    """``ns_backend="auto"`` on one stack shape: the name of the fastest candidate
    (:func:`time_iterations`) among those that agree with ``candidates["torch"]`` (relative
    distance at most :data:`AGREEMENT` of the dtype); ties go to ``"torch"``, which is never
    slower than itself."""
    timed = time_iterations(candidates, X, coefficients, buffers, repeats=repeats,
                            time_of=time_of)
    agree = [name for name, t in timed.items()
             if name == "torch" or t["distance"] <= AGREEMENT[X.dtype]]
    return min(agree, key=lambda name: (timed[name]["seconds"], name != "torch"))


#: The most two backends' Newton–Schulz results may differ (relative Frobenius distance) and
#: still count as the same computation in that dtype: a few units of its rounding, amplified
#: by the iteration (broken kernels differ by order 1).
AGREEMENT = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4,
             torch.float64: 1e-10}


def wall_time(run: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds one call of ``run`` takes, ``device``'s queued work waited for before and after
    (a CUDA device synchronized; a CPU needs nothing)."""
    device = torch.device(device)
    device_sync = ((lambda: torch.cuda.synchronize(device)) if device.type == "cuda"
                   else (lambda: None))
    device_sync()
    start = time.perf_counter()
    run()
    device_sync()
    return time.perf_counter() - start


def gram_iterate(X: Tensor, coefficients, buffers: dict[str, Tensor]) -> Tensor:
    """Newton–Schulz steps on a normalized wide stack ``X`` (k, m ≤ n) carried in Gram space, in
    the buffers :meth:`GramIteration.requests` names.

    Per segment of at most :data:`GRAM_RESTART` steps: ``R = X Xᵀ``; each step forms
    ``P = a·I + b·R + c·R²``, multiplies ``Q ← Q P`` (all factors are polynomials in the
    segment's first ``R``, so they commute) and, unless it is the segment's last,
    ``R ← P R P``; the segment ends with ``X ← Q X``. Every m×m matrix is held *split*: its
    diagonal in float32, its off-diagonal part in ``X``'s dtype. The diagonal dominates these
    matrices, and rounding it to bf16 at every product is what made the plain Gram order less
    accurate than the standard one; split, it is more accurate (:data:`GRAM_RESTART`). The
    products cost the same matmuls plus a few element-wise passes.
    """
    full, scratch = buffers["gram_full"], buffers["gram_mm"]

    def split(name: str) -> tuple[Tensor, Tensor]:
        return buffers[f"gram_{name}_diag"], buffers[f"gram_{name}_off"]

    def product(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor:
        """``full ← (diag(a₀) + a₁)(diag(b₀) + b₁)``."""
        full.copy_(torch.bmm(a[1], b[1], out=scratch))
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
        torch.bmm(X, X.mT, out=R[1])
        torch.linalg.vector_norm(X, dim=-1, dtype=R[0].dtype, out=R[0]).square_()
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
        out = torch.bmm(Q[1], X, out=buffers[("gram_x0", "gram_x1")[s % 2]])
        X = out.addcmul_(Q[0].unsqueeze(-1), X)
    return X


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
