"""The Optuna distribution of every search axis, so that each trial carries its point as
Optuna ``params`` (``trial.params``, ``study.trials_dataframe()``, ``optuna.visualization``,
``optuna-dashboard``) in a grid, a grown grid, a coordinate descent and a TPE search alike.

An open TPE search declares its own (``search.params``: ``suggest_float/int/categorical``).
For a planned study (a grid or a coordinate descent, whose points the driver chooses), an axis
of numbers gets a ``FloatDistribution`` (``log=True`` on a log-spaced axis such as the learning
rate, :func:`muoneq.suite.sweeps.plan.spacing`) or an ``IntDistribution`` (integers on a linear
scale, such as K), spanning every value the axis can take: its values in the sweep file and,
when it is bracketed, ``bracket.max_extensions`` more steps beyond each edge of each block
(:func:`muoneq.suite.sweeps.plan.step`, within ``bracket.bounds``). Any other axis (optimizer, mode,
experiment, a boolean) gets a ``CategoricalDistribution`` of its values.

Optuna keeps one distribution per parameter name in a study and compares them between trials
(its importances and intersection search spaces need them equal), and a categorical's choices
may never change ("CategoricalDistribution does not support dynamic value space"). So the
distributions are recorded in the study when it is created and only widened later
(:func:`merge`) when an edited sweep file takes a numeric axis beyond its range; a value a
recorded categorical lacks (an optimizer added to the grid later) stays out of its trials'
params (the driver says so), while the run itself goes on as usual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
    json_to_distribution,
)

from muoneq.suite.sweeps.plan import spacing, step
from muoneq.suite.sweeps.spec import SweepSpec

Distributions = dict[str, BaseDistribution]


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def axis_blocks(spec: SweepSpec) -> dict[str, list[list[Any]]]:
    """Each axis' values per grid block (a coordinate descent: its values and start)."""
    out: dict[str, list[list[Any]]] = {}
    if spec.search is not None:
        for name, p in spec.search.params.items():
            out[name] = [list(dict.fromkeys([*(p.values or []), spec.search.start.get(name)]))]
        return out
    for block in spec.grid:
        for axis, values in block.items():
            out.setdefault(axis, []).append(list(values))
    return out


def _reach(spec: SweepSpec, axis: str, values: list, scale: str) -> tuple[float, float]:
    """The lowest and highest value bracketing can add to a block's ``values`` of ``axis``."""
    low, high = min(values), max(values)
    b = spec.bracket
    if b is None or axis not in b.axes or len(set(values)) < 2:
        return low, high
    lo_bound, hi_bound = b.bounds.get(axis) or (None, None)
    for side in ("low", "high"):
        grown = sorted(set(values))
        for _ in range(b.max_extensions):
            nxt = step(grown, side, scale)
            if (scale == "log" and nxt <= 0) or (lo_bound is not None and nxt < lo_bound) or (
                    hi_bound is not None and nxt > hi_bound):
                break
            grown = sorted({*grown, nxt})
        low, high = min(low, grown[0]), max(high, grown[-1])
    return low, high


def spec_distributions(spec: SweepSpec) -> Distributions:
    """Every axis' distribution as the sweep file describes it (module docstring)."""
    if not spec.planned:
        out: Distributions = {}
        for name, p in spec.search.params.items():
            if p.type == "float":
                out[name] = FloatDistribution(p.low, p.high, log=p.log)
            elif p.type == "int":
                out[name] = IntDistribution(int(p.low), int(p.high), log=p.log)
            else:
                out[name] = CategoricalDistribution(list(p.choices))
        return out
    out = {}
    for axis, blocks in axis_blocks(spec).items():
        values = [v for block in blocks for v in block]
        if not _numeric(values):
            out[axis] = CategoricalDistribution(list(dict.fromkeys(values)))
            continue
        choice = spec.bracket.scale.get(axis, "auto") if spec.bracket is not None else "auto"
        scale = spacing(values, choice) if len(set(values)) > 1 else "linear"
        reach = [_reach(spec, axis, block, scale) for block in blocks]
        low, high = min(r[0] for r in reach), max(r[1] for r in reach)
        if all(isinstance(v, int) for v in values) and scale == "linear":
            out[axis] = IntDistribution(int(low), int(high))
        else:
            out[axis] = FloatDistribution(float(low), float(high), log=scale == "log")
    return out


def merge(recorded: Mapping[str, BaseDistribution], fresh: Mapping[str, BaseDistribution]
          ) -> Distributions:
    """The recorded distributions, a numeric one widened to cover ``fresh``'s range, and the
    axes ``fresh`` adds (a recorded categorical is kept as it is: see the module docstring)."""
    out = dict(recorded)
    for axis, new in fresh.items():
        old = out.get(axis)
        if old is None:
            out[axis] = new
        elif isinstance(old, FloatDistribution | IntDistribution) and isinstance(new, type(old)):
            low, high = min(old.low, new.low), max(old.high, new.high)
            if (low, high) != (old.low, old.high):
                out[axis] = type(old)(low, high, log=old.log)
    return out


def to_json(dists: Mapping[str, BaseDistribution]) -> dict[str, str]:
    return {name: distribution_to_json(d) for name, d in dists.items()}


def from_json(data: Mapping[str, str] | None) -> Distributions:
    return {name: json_to_distribution(text) for name, text in (data or {}).items()}


def contains(dist: BaseDistribution, value: Any) -> bool:
    """Whether ``value`` is one of ``dist``'s (numbers within its range, a categorical's
    choices)."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if isinstance(dist, IntDistribution) and value != int(value):
        return False
    return dist.low <= value <= dist.high
