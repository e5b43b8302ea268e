"""Newton–Schulz steps in this project's Triton kernels: ``ns_backend="triton"``.

Each step ``X ← a·X + (b·A + c·A²)·X``, ``A = X·Xᵀ``, of a stack ``(k, m, n)`` is two kernels
(one program per output tile and matrix) and one batched cuBLAS product:

* :func:`_symmetric_kernel` — ``A = Y·Yᵀ`` for the wide view ``Y`` of each matrix (``X``
  itself, or ``Xᵀ`` for a tall one, read through its strides: tall matrices stay tall in memory
  and ``A`` is the small ``XᵀX``). ``A`` is symmetric: only the tiles on and below the diagonal
  are computed, and their lower triangles stored twice, mirrored (``A`` exactly symmetric);
* the same kernel, ``B = b·A + c·A·A`` fused (``A·A`` symmetric too: one triangle, mirrored);
* ``X' = a·X + B·X`` on cuBLAS (``torch.baddbmm``) in :func:`iterate_stack`;
  :func:`_apply_kernel` fuses it (written through the strides of the output, tall again for a
  tall ``X``), kept to measure against.

Products accumulate in float32 (``tl.dot``), float32 inputs in IEEE precision (no TF32, as
torch's default matmul), and each result is cast once to the stack's dtype, as cuBLAS does for
``torch.baddbmm``: the two agree within the rounding of that dtype. A matrix's offset in the
stack is computed in 64 bits (a stack can exceed 2³¹ elements). The tiles, warps and pipeline
stages come from :data:`CONFIGS` by the GPU's compute capability; :data:`CHOSEN` records which
configuration each device ran. The kernels launch on CUDA tensors; with ``TRITON_INTERPRET=1``
set before this module is imported, Triton's interpreter runs them on CPU tensors (slowly: the
tests do, with the interpreter's bf16 products and rounding corrected on their side,
``tests/helpers/triton_interpreter.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class LaunchConfig:
    """Output tile (rows and columns), reduction tile, warps and pipeline stages of every
    kernel, and what chose them."""

    block: int
    block_k: int
    num_warps: int
    num_stages: int
    source: str


#: Configurations by CUDA compute capability (major version): Hopper and Blackwell take
#: 128-wide tiles in 8 warps (modded-nanogpt's H100 tiles), Ampere 64-wide in 4; anything
#: else, and Triton's interpreter, the 64-wide default. Not autotuned: one configuration per
#: architecture, recorded in :data:`CHOSEN`.
CONFIGS = {
    9: LaunchConfig(128, 64, 8, 4, "sm90 (Hopper)"),
    10: LaunchConfig(128, 64, 8, 4, "sm100 (Blackwell)"),
    8: LaunchConfig(64, 32, 4, 3, "sm80 (Ampere)"),
}
DEFAULT_CONFIG = LaunchConfig(64, 32, 4, 2, "default")
#: The configuration each device ran (``str(device)`` → :class:`LaunchConfig`).
CHOSEN: dict[str, LaunchConfig] = {}


@triton.jit
def _tile_product(L, l_r, l_c, R, r_r, r_c, ri, rj, rows, cols, inner, BLOCK: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``Σₖ L[ri, k]·R[k, rj]`` in float32 (``L``: ``rows × inner``, ``R``: ``inner × cols``,
    both through their strides; rows and columns beyond the ends read as 0)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for start in range(0, inner, BLOCK_K):
        kk = (start + rk).to(tl.int64)  # 64-bit: kk·stride stays exact past 2³¹
        left = tl.load(L + ri[:, None] * l_r + kk[None, :] * l_c,
                       mask=(ri[:, None] < rows) & (kk[None, :] < inner), other=0.0)
        right = tl.load(R + kk[:, None] * r_r + rj[None, :] * r_c,
                        mask=(kk[:, None] < inner) & (rj[None, :] < cols), other=0.0)
        acc = tl.dot(left, right, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _symmetric_kernel(L, Out, rows, inner, l_b, l_r, l_c, r_r, r_c, o_b, o_r, o_c, coef_b, coef_c,
                      POLYNOMIAL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    """A symmetric product per matrix ``k``, tile ``(i, j)`` for ``i ≥ j`` only, stored at
    ``(i, j)`` and ``(j, i)``: ``Out = L·Lᵀ`` (the Gram matrix; ``Lᵀ`` is ``L`` read with its
    strides ``(r_r, r_c)`` swapped), or with ``POLYNOMIAL`` ``Out = b·L + c·L·L`` for a symmetric
    ``L`` (the polynomial of a Newton–Schulz step)."""
    # 64-bit indices: every offset (k·batch stride, row·row stride) stays exact past 2³¹
    i, j, k = (tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
               tl.program_id(2).to(tl.int64))
    if j > i:
        return
    ri = i * BLOCK + tl.arange(0, BLOCK)
    rj = j * BLOCK + tl.arange(0, BLOCK)
    L += k * l_b
    out = _tile_product(L, l_r, l_c, L, r_r, r_c, ri, rj, rows, rows, inner, BLOCK, BLOCK_K,
                        PRECISION)
    if POLYNOMIAL:
        here = tl.load(L + ri[:, None] * l_r + rj[None, :] * l_c,
                       mask=(ri[:, None] < rows) & (rj[None, :] < rows), other=0.0)
        out = coef_b * here.to(tl.float32) + coef_c * out
    _store_symmetric(Out + k * o_b, out.to(Out.dtype.element_ty), ri, rj, rows, o_r, o_c)


@triton.jit
def _store_symmetric(T, tile, ri, rj, rows, t_r, t_c):
    """Store the lower triangle of a tile of a symmetric result, and its mirror image: the
    result is exactly symmetric (a diagonal tile's upper half is its lower half's copy)."""
    mask = (ri[:, None] < rows) & (rj[None, :] < rows) & (ri[:, None] >= rj[None, :])
    tl.store(T + ri[:, None] * t_r + rj[None, :] * t_c, tile, mask=mask)
    tl.store(T + rj[None, :] * t_r + ri[:, None] * t_c, tile, mask=mask)


@triton.jit
def _apply_kernel(Y, B, Z, rows, cols, y_b, y_r, y_c, b_b, b_r, b_c, z_b, z_r, z_c, coef_a,
                  BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``Z[k] = a·Y[k] + B[k]·Y[k]`` (``Y``, ``Z``: ``rows × cols``; ``B``: ``rows × rows``)."""
    # 64-bit indices: every offset (k·batch stride, row·row stride) stays exact past 2³¹
    i, j, k = (tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
               tl.program_id(2).to(tl.int64))
    ri = i * BLOCK + tl.arange(0, BLOCK)
    rj = j * BLOCK + tl.arange(0, BLOCK)
    Y += k * y_b
    acc = _tile_product(B + k * b_b, b_r, b_c, Y, y_r, y_c, ri, rj, rows, cols, rows, BLOCK,
                        BLOCK_K, PRECISION)
    mask = (ri[:, None] < rows) & (rj[None, :] < cols)
    here = tl.load(Y + ri[:, None] * y_r + rj[None, :] * y_c, mask=mask, other=0.0)
    out = coef_a * here.to(tl.float32) + acc
    tl.store(Z + k * z_b + ri[:, None] * z_r + rj[None, :] * z_c,
             out.to(Z.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    """Whether Triton's interpreter runs these kernels (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_symmetric_kernel, InterpretedFunction)


def check_tensor(X: Tensor) -> None:
    """Refuse, with a one-line error, a stack the kernels cannot run."""
    if X.device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            f"ns_backend='triton': the kernels run on CUDA tensors, got {X.device.type}; set "
            "TRITON_INTERPRET=1 before importing muoneq to run them on CPU (slowly, for tests)"
        )
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"ns_backend='triton': Newton–Schulz in {X.dtype} is not supported; allowed: "
            "bfloat16, float16, float32 (use ns_backend='torch' for float64)"
        )


def launch_config(device: torch.device) -> LaunchConfig:
    """The configuration of ``device``'s architecture (:data:`CONFIGS`), recorded in
    :data:`CHOSEN`."""
    key = str(device)
    if key not in CHOSEN:
        config = DEFAULT_CONFIG
        if device.type == "cuda" and not _interpreted():
            config = CONFIGS.get(torch.cuda.get_device_capability(device)[0], DEFAULT_CONFIG)
        CHOSEN[key] = config
    return CHOSEN[key]


def _options(X: Tensor) -> dict:
    return _launch_options(X.dtype, X.device)


@functools.cache
def _launch_options(dtype: torch.dtype, device: torch.device) -> dict:
    check_tensor(torch.empty(0, dtype=dtype, device=device))
    config = launch_config(device)
    return {"BLOCK": config.block, "BLOCK_K": config.block_k, "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "PRECISION": "ieee" if dtype == torch.float32 else None}


def symmetric_gram(Y: Tensor, out: Tensor) -> Tensor:
    """``out[k] = Y[k]·Y[k]ᵀ`` for a stack ``Y`` ``(k, r, c)`` of any strides."""
    k, rows, inner = Y.shape
    tiles = triton.cdiv(rows, launch_config(Y.device).block)
    _symmetric_kernel[(tiles, tiles, k)](Y, out, rows, inner, *Y.stride(), Y.stride(2),
                                         Y.stride(1), *out.stride(), 0.0, 0.0, POLYNOMIAL=False,
                                         **_options(Y))
    return out


def symmetric_polynomial(A: Tensor, b: float, c: float, out: Tensor) -> Tensor:
    """``out[k] = b·A[k] + c·A[k]·A[k]`` for a stack of symmetric matrices."""
    k, rows, _ = A.shape
    tiles = triton.cdiv(rows, launch_config(A.device).block)
    _symmetric_kernel[(tiles, tiles, k)](A, out, rows, rows, *A.stride(), A.stride(1),
                                         A.stride(2), *out.stride(), b, c, POLYNOMIAL=True,
                                         **_options(A))
    return out


def apply_polynomial(Y: Tensor, B: Tensor, a: float, out: Tensor) -> Tensor:
    """``out[k] = a·Y[k] + B[k]·Y[k]`` (``out`` of ``Y``'s shape, any strides)."""
    k, rows, cols = Y.shape
    block = launch_config(Y.device).block
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block), k)
    _apply_kernel[grid](Y, B, out, rows, cols, *Y.stride(), *B.stride(), *out.stride(), a,
                        **_options(Y))
    return out


def iterate_stack(X: Tensor, coefficients, *, other: Tensor, gram: Tensor,
                  poly: Tensor) -> Tensor:
    """Newton–Schulz steps with the symmetric products in these kernels and the third one,
    ``a·X + B·X``, on cuBLAS (``torch.baddbmm``, as microsoft/dion does; ``X·B`` for a tall
    stack): :class:`muoneq.newton_schulz.StackIteration`'s buffers, its result within the
    rounding of ``X``'s dtype. The iterate alternates between ``X`` and ``other``, a tall stack
    read through its transposed view; returns the buffer of the last.
    :func:`apply_polynomial` fuses the third product instead (kept for measuring it)."""
    tall = X.size(-2) > X.size(-1)
    current, following = X, other
    for a, b, c in coefficients:
        symmetric_gram(current.mT if tall else current, gram)
        symmetric_polynomial(gram, b, c, poly)
        if tall:
            torch.baddbmm(current, current, poly, beta=a, out=following)
        else:
            torch.baddbmm(current, poly, current, beta=a, out=following)
        current, following = following, current
    return current
