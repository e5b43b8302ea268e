"""What every optimizer of the package does to honour the ``torch.optim`` contract.

``torch.optim.Optimizer`` gives param groups, state dicts, hooks and ``zero_grad``; the rest
of the contract (as PyTorch's own generic optimizer tests check it, ``TestOptimRenewed``) is
each optimizer's job and lives here, shared by the hybrid optimizers and MARS-AdamW:

* hyper-parameters validated with one-line errors naming the key; a learning rate may be a
  1-element tensor of any shape (read once per group and step, as torch's non-capturable
  optimizers do); torch's implementation flags (``foreach``, ``fused``, ``capturable``,
  ``differentiable``, ``maximize``) are refused, since silently ignoring them would lie;
* unknown group keys are kept as metadata (as torch keeps ``name``), but one within two
  edits of a hyper-parameter warns with a "did you mean";
* the step evaluates the closure with gradients enabled and skips parameters without a
  gradient; sparse gradients raise;
* state dicts of older versions load: a ``step`` saved as a Python number becomes a tensor
  again (as ``torch.optim.AdamW`` does).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from numbers import Real

import torch
from torch import Tensor

#: torch.optim implementation flags this package does not implement.
UNSUPPORTED_FLAGS = ("foreach", "fused", "capturable", "differentiable", "maximize")
#: Group keys torch.optim itself or its schedulers use as metadata (never typo-checked).
METADATA_KEYS = ("params", "param_names", "name", "initial_lr")


def evaluate_closure(closure: Callable[[], float] | None):
    """Lightning's contract for ``optimizer.step(closure)``: run it with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grads(group: dict, optimizer: str) -> list[Tensor]:
    """The group's parameters that have a (dense) gradient this step."""
    params = [p for p in group["params"] if p.grad is not None]
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError(f"{optimizer} does not support sparse gradients")
    return params


def check_number(group: dict, key: str, *, low: float = 0.0, high: float | None = None,
                 high_open: bool = False, value=None) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``group[key]`` (or ``value``) is a number in
    ``[low, high]`` (``[low, high)`` with ``high_open``); 1-element tensors count as numbers."""
    value = group[key] if value is None else value
    shown = value
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
        value = value.item()
    if not isinstance(value, Real) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{key}: expected a number, got {shown!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = "" if high is None else f" and {'<' if high_open else '≤'} {high}"
        raise ValueError(f"{key}: must be ≥ {low}{bound}, got {shown!r}")


def check_betas(group: dict, key: str) -> None:
    """Two numbers in [0, 1), stored as a tuple."""
    betas = group[key]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{key}: expected two numbers in [0, 1), got {betas!r}")
    group[key] = tuple(betas)
    for i, beta in enumerate(betas):
        check_number(group, f"{key}[{i}]", high=1.0, high_open=True, value=beta)


def check_flag(group: dict, key: str) -> None:
    if not isinstance(group[key], bool):
        raise ValueError(f"{key}: expected True or False, got {group[key]!r}")


def check_group_keys(group: dict, known: Iterable[str], optimizer: str) -> None:
    """Refuse torch flags this package does not implement; warn on near-misses of a
    hyper-parameter name — within two edits, one for keys of up to five letters — (other
    unknown keys are metadata, as in torch.optim)."""
    known = set(known)
    for flag in UNSUPPORTED_FLAGS:
        if group.get(flag) and flag not in known:
            raise ValueError(
                f"{flag}: not supported by {optimizer} (a torch.optim implementation flag); "
                f"remove it from the param group"
            )
    for key in group:
        if key in known or key in METADATA_KEYS or key in UNSUPPORTED_FLAGS:
            continue
        close = sorted((edit_distance(key, k), k) for k in known)
        if close and close[0][0] <= min(2, len(key) // 3):
            warnings.warn(
                f"{optimizer}: param group key {key!r} is not a hyper-parameter (kept as "
                f"metadata); did you mean {close[0][1]!r}?",
                UserWarning, stacklevel=4,
            )


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and
    transpositions of neighbours each count as one edit (no such function in the stdlib)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def scalar(value):
    """A hyper-parameter as a Python number: 1-element tensors are read once (``.item()``)."""
    return value.item() if isinstance(value, Tensor) else value


def tensor_steps(state: dict) -> None:
    """Older state dicts saved ``step`` as a Python number; the step functions expect a
    float32 tensor, as ``torch.optim.AdamW`` keeps it."""
    for per_param in state.values():
        if isinstance(per_param, dict) and "step" in per_param:
            if not torch.is_tensor(per_param["step"]):
                per_param["step"] = torch.tensor(float(per_param["step"]), dtype=torch.float32)
