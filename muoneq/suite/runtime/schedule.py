"""Learning-rate schedules by optimizer step (or epoch): linear warmup, then cosine or constant.

The factor multiplies every param group's initial lr (so the AdamW fallback group of a hybrid
optimizer follows the matrix group), as ``torch.optim.lr_scheduler.LambdaLR`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum

import torch
from torch.optim.lr_scheduler import LambdaLR


class ScheduleName(Enum):
    cosine = "cosine"
    constant = "constant"


class ScheduleInterval(Enum):
    """What the schedule counts: optimizer steps (LLM recipes) or epochs (the authors' CIFAR
    script: ``CosineAnnealingLR(T_max=epochs)`` stepped once per epoch)."""

    step = "step"
    epoch = "epoch"


def lr_factor(
    step: int, *, name: ScheduleName | str, warmup_steps: int, total_steps: int,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based).

    Warmup: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (never 0, so the first
    step moves). Cosine: ``r + (1 − r)·(1 + cos(π·t))/2`` with ``t`` the fraction of the
    post-warmup steps done (0 at the end of warmup, 1 at ``total_steps``) and ``r`` =
    ``min_lr_ratio``. Constant: 1 after warmup.
    """
    name = ScheduleName(name) if isinstance(name, str) else name
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name is ScheduleName.constant:
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def schedule_warnings(
    *, name: ScheduleName | str, interval: ScheduleInterval | str, warmup_steps: int,
    total_steps: int | None, budget: int, min_lr_ratio: float = 0.0,
) -> list[str]:
    """What makes no sense in a schedule for a run of ``budget`` optimizer steps (or epochs,
    with ``interval=epoch``): a warmup that never ends, and a ``total_steps`` other than the
    run's length. One sentence each: what happens, then ``;`` and what to change."""
    name = ScheduleName(name) if isinstance(name, str) else name
    unit = "epochs" if ScheduleInterval(interval) is ScheduleInterval.epoch else "optimizer steps"
    length = total_steps or budget
    out = []
    if warmup_steps >= min(length, budget):
        last = lr_factor(budget - 1, name=name, warmup_steps=warmup_steps, total_steps=length,
                         min_lr_ratio=min_lr_ratio)
        than = (f"this run's {budget} {unit}" if budget <= length else
                f"schedule.total_steps={length}")
        out.append(
            f"schedule.warmup_steps={warmup_steps} is not shorter than {than}: the lr never "
            f"decays, and the run's last step uses {last:.2g} × optimizer.lr; lower "
            "schedule.warmup_steps")
    if name is not ScheduleName.constant and total_steps is not None and total_steps != budget:
        if total_steps < budget:
            what = (f"the cosine ends after {total_steps} and the last {budget - total_steps} "
                    f"{unit} stay at min_lr_ratio × optimizer.lr")
        else:
            what = (f"training stops at {budget}, before the cosine reaches its end "
                    f"({total_steps})")
        out.append(f"schedule.total_steps={total_steps} differs from this run's {budget} {unit}: "
                   f"{what}; set schedule.total_steps=null to follow the trainer's budget")
    return out


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, name: ScheduleName | str, warmup_steps: int,
    total_steps: int | Callable[[], int], min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` stepping :func:`lr_factor` once per optimizer step.

    ``total_steps`` may be a function, called once when the decay first needs it (after the
    first post-warmup step). The runtime passes the trainer's ``estimated_stepping_batches``
    this way: asking for it inside ``configure_optimizers`` would build the training loader
    before Lightning restores a checkpoint's loop state, and a resumed run would then draw its
    first epoch's batches from the wrong position.
    """
    name = ScheduleName(name) if isinstance(name, str) else name
    resolved: list[int] = [] if callable(total_steps) else [int(total_steps)]

    def factor(step: int) -> float:  # a plain function: LambdaLR leaves it out of state_dict
        if step <= warmup_steps or name is ScheduleName.constant:
            total = warmup_steps + 1  # not used by lr_factor in these cases
        else:
            if not resolved:
                resolved.append(int(total_steps()))
            total = resolved[0]
        return lr_factor(
            step, name=name, warmup_steps=warmup_steps, total_steps=total,
            min_lr_ratio=min_lr_ratio,
        )

    return LambdaLR(optimizer, factor)
