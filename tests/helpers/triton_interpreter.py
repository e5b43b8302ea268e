"""Triton's interpreter as the tests run this project's kernels on CPU: its bf16 arithmetic
corrected here, not in the kernels (``muoneq/ns_triton.py`` is what a GPU compiles).

Triton 3.8's interpreter keeps bf16 tensors as ``uint16`` and multiplies those integers in
``tl.dot`` (wrong by orders of magnitude), and it truncates float32 to bf16 (a GPU rounds to
nearest even). :func:`corrected` makes ``tl.dot`` widen bf16 operands to float32 and a
float32-to-bf16 cast round to nearest even (torch's conversion), for as long as it is active.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


def _to_float(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(
        torch.bfloat16).float().numpy()


def _to_bf16(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).bfloat16().view(
        torch.int16).numpy().view(np.uint16)


@contextlib.contextmanager
def corrected():
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = TensorHandle(_to_float(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = TensorHandle(_to_float(b.data), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_to_bf16(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl
    try:
        yield
    finally:
        InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = dot, cast
