"""Checks of hyper-parameter values and param-group keys, shared by every optimizer here.

A check is ``check(key, value, group) -> value``: it returns the value in its canonical form
(a tuple for betas, a dtype's name, …) or raises a one-line ``ValueError`` that names the key
and what is allowed. :class:`muoneq.optim.base.Hyper` attaches one to each hyper-parameter.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable, Iterable
from numbers import Real

import torch
from torch import Tensor

Check = Callable[[str, object, dict], object]

#: torch.optim implementation flags this package does not implement.
UNSUPPORTED_FLAGS = ("foreach", "fused", "capturable", "differentiable", "maximize")
#: Group keys torch.optim itself or its schedulers use as metadata (never typo-checked).
METADATA_KEYS = ("params", "param_names", "name", "initial_lr")


def number(low: float = 0.0, high: float | None = None, *, high_open: bool = False) -> Check:
    """A number in ``[low, high]`` (``[low, high)`` with ``high_open``); a 1-element tensor
    counts as its value (a tensor learning rate, as torch.optim allows)."""

    def check(key: str, value, group: dict):
        plain = value
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
            plain = value.item()
        if not isinstance(plain, Real) or isinstance(plain, bool) or math.isnan(plain):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        if plain < low or (high is not None and (plain >= high if high_open else plain > high)):
            bound = "" if high is None else f" and {'<' if high_open else '≤'} {high}"
            raise ValueError(f"{key}: must be ≥ {low}{bound}, got {value!r}")
        return value

    return check


#: A number ≥ 0 (learning rates, weight decay, eps, …) and one in [0, 1) (decays).
nonnegative = number()
decay = number(high=1.0, high_open=True)


def integer(low: int) -> Check:
    def check(key: str, value, group: dict):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key}: expected an integer ≥ {low}, got {value!r}")
        return value

    return check


def boolean(key: str, value, group: dict):
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected True or False, got {value!r}")
    return value


def betas(key: str, value, group: dict):
    """Two decays in [0, 1), stored as a tuple."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"{key}: expected two numbers in [0, 1), got {value!r}")
    return tuple(decay(f"{key}[{i}]", beta, group) for i, beta in enumerate(value))


def choice(*allowed: str, normalize: Callable[[str], str] = str) -> Check:
    """One of ``allowed`` after ``normalize`` (e.g. ``str.lower``)."""

    def check(key: str, value, group: dict):
        canonical = normalize(value) if isinstance(value, str) else value
        if canonical not in allowed:
            raise ValueError(f"{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")
        return canonical

    return check


def converted(convert: Callable) -> Check:
    """A value checked and canonicalized by ``convert(value)``, which raises its own error."""
    return lambda key, value, group: convert(value)


def check_group_keys(group: dict, known: Iterable[str], optimizer: str) -> None:
    """Refuse torch flags this package does not implement; warn on near-misses of a
    hyper-parameter name — within two edits, one for keys of three to five letters (other
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
                UserWarning, stacklevel=5,
            )


def closest(key: str, known: Iterable[str]) -> str | None:
    """The accepted name ``key`` most likely misspells: one that has ``key`` as a
    ``_``-separated part (``betas`` → ``adamw_betas``), else the nearest within two edits,
    else difflib's closest match; ``None`` when nothing is close."""
    known = list(known)
    parts = [k for k in known if key.lower() in k.lower().split("_")]
    if parts:
        return parts[0]
    close = sorted((edit_distance(key, k), k) for k in known)
    if close and close[0][0] <= min(2, max(1, len(key) // 3)):
        return close[0][1]
    matches = difflib.get_close_matches(key, known, n=1)
    return matches[0] if matches else None


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and
    transpositions of neighbours each count as one edit (no such function in the stdlib)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def scalar(value):
    """A hyper-parameter as a Python number: 1-element tensors are read once (``.item()``)."""
    return value.item() if isinstance(value, Tensor) else value


def tensor_steps(state: dict) -> None:
    """Older state dicts saved ``step`` as a Python number; the steps here expect a float32
    tensor, as ``torch.optim.AdamW`` keeps it."""
    for per_param in state.values():
        if isinstance(per_param, dict) and "step" in per_param:
            if not torch.is_tensor(per_param["step"]):
                per_param["step"] = torch.tensor(float(per_param["step"]), dtype=torch.float32)
