"""Which points a study runs: its grid grown until every optimum is bracketed, or the path of a
coordinate descent.

Both are pure functions of the results so far (:class:`Results`): every driver, on every
machine, derives the same plan from the same finished runs, so a plan needs no storage of its
own, and a killed driver resumes by deriving it again. The scheduler runs the plan's points
(each on every seed); the plan grows as their results come in.

**Bracketing** (``bracket: {axes: [optimizer.lr], max_extensions: 4}``). A *family* is the
points of one grid block that agree on every axis not bracketed (in the paper's studies: one
optimizer, mode, K…). Once each of its runs has finished (or failed for good), the family's best
point by the mean over seeds is found; on each bracketed axis where it sits on an edge, the next
value beyond that edge is added, continuing the grid's own spacing on that side (:func:`step`),
for every value of the family's other bracketed axes, and the family waits for those runs. It
stops when the best is interior, when ``max_extensions`` values were added on that axis, or when
the next value leaves the axis' valid range (``bracket.bounds``, a log axis' ``> 0``, or a
training config that refuses it), and says which.

**Coordinate descent** (``search: {type: coordinate, …}``). From ``search.start``, one axis at a
time is swept over its ``values`` with the others at the current best; the best point of the
sweep becomes the current one when it improves the objective by more than ``threshold``
(relative). Cycles over the axes end when a whole cycle moves nothing or after ``max_cycles``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from muoneq.suite.sweeps.spec import Point, SweepSpec, format_value

#: what a plan knows of a point: the objective of each seed's finished run (None: diverged),
#: or the point is absent when some of its seeds have not finished yet
Results = Mapping[str, Sequence[float | None]]
#: ``check(point)``: why a point cannot run (a config error), or None when it can
Check = Callable[[Point], str | None]


def score(values: Sequence[float | None] | None, direction: str) -> float | None:
    """The mean over seeds, turned so that lower is better; +inf when a seed diverged; None
    without any finished seed (every run failed for good)."""
    if not values:
        return None
    if any(v is None or not math.isfinite(v) for v in values):
        return math.inf
    mean = sum(values) / len(values)
    return mean if direction == "minimize" else -mean


def mean(values: Sequence[float | None] | None) -> float | None:
    """The plain mean over seeds (None without a finished seed; NaN when one diverged)."""
    if not values:
        return None
    if any(v is None for v in values):
        return math.nan
    return sum(values) / len(values)


def _best(points: Sequence[Point], results: Results, direction: str) -> Point | None:
    """The point with the best score (the first of equals, in order), None if none has one."""
    scored = [(score(results[p.key], direction), i, p) for i, p in enumerate(points)]
    scored = [s for s in scored if s[0] is not None]
    return min(scored, key=lambda s: (s[0], s[1]))[2] if scored else None


# --------------------------------------------------------------------------------- spacing
def spacing(values: Sequence[float], scale: str) -> str:
    """``log`` or ``linear``: the scale a bracketed axis continues on. ``auto`` is ``log`` for
    positive float values at least 1.5× apart on average (learning-rate-like grids),
    ``linear`` otherwise (momenta, integers)."""
    if scale != "auto":
        return scale
    v = sorted(values)
    if all(isinstance(x, int) for x in v) or v[0] <= 0:
        return "linear"
    return "log" if (v[-1] / v[0]) ** (1 / (len(v) - 1)) >= 1.5 else "linear"


def step(values: Sequence[float], side: str, scale: str) -> float:
    """The next value beyond the ``side`` (``low``/``high``) edge of ``values``, at the spacing
    of the two values nearest that edge: their ratio on a log scale, their difference on a
    linear one (integers stay integers; floats are rounded to 12 significant digits)."""
    v = sorted(values)
    inner, edge = (v[1], v[0]) if side == "low" else (v[-2], v[-1])
    nxt = edge * edge / inner if scale == "log" else 2 * edge - inner
    if all(isinstance(x, int) for x in v):
        return int(round(nxt))
    return float(f"{nxt:.12g}")


# ------------------------------------------------------------------------------ bracketing
@dataclass
class AxisStatus:
    """One bracketed axis of one family."""

    axis: str
    scale: str
    added: list[Any] = field(default_factory=list)  #: values beyond the original grid
    edge: str | None = None  #: ``low``/``high`` when the best sits there at the end
    stopped: str = ""  #: why no further value was added at that edge


@dataclass
class Family:
    """The points of one grid block that agree on every axis not bracketed."""

    block: int
    fixed: dict[str, Any]  #: the values of the axes not bracketed
    axes: dict[str, list[Any]]  #: bracketed axis → its values so far (original + added)
    status: list[AxisStatus] = field(default_factory=list)
    best: Point | None = None  #: the best point once every run has finished
    best_value: float | None = None  #: its mean objective over seeds
    state: str = "running"  #: running, bracketed, edge (not bracketed), no result

    @property
    def label(self) -> str:
        return Point(tuple(self.fixed.items())).key or "(all)"

    def points(self, order: Sequence[str]) -> list[Point]:
        names = list(self.axes)
        out = []
        for values in product(*(self.axes[a] for a in names)):
            assignment = {**self.fixed, **dict(zip(names, values, strict=True))}
            out.append(Point(tuple((a, assignment[a]) for a in order if a in assignment)))
        return out


@dataclass
class Plan:
    """The points to run (each on every seed), in order, and what the plan says about them."""

    points: list[Point]
    finished: bool  #: no point will be added (every result the plan depends on is in)
    families: list[Family] = field(default_factory=list)  #: bracketing
    path: list[tuple[str | None, Point, float | None]] = field(default_factory=list)  #: CD
    state: str = ""  #: coordinate descent: running, converged, max_cycles, no result

    def to_dict(self) -> dict:
        """Plain data (JSON), as the driver publishes it for reports and ``--status``."""
        return {
            "finished": self.finished, "state": self.state,
            "families": [{
                "label": f.label, "block": f.block, "fixed": f.fixed, "state": f.state,
                "best": f.best.as_dict() if f.best is not None else None,
                "best_value": f.best_value,
                "axes": [{"axis": s.axis, "scale": s.scale, "values": f.axes[s.axis],
                          "added": s.added, "edge": s.edge, "stopped": s.stopped}
                         for s in f.status]} for f in self.families],
            "path": [{"axis": axis, "point": point.as_dict(), "value": value}
                     for axis, point, value in self.path],
        }

    def lines(self) -> list[str]:
        """What the plan added and why it stopped (:func:`describe_plan`)."""
        return describe_plan(self.to_dict())


def describe_plan(said: dict) -> list[str]:
    """One line per bracketed axis of each family, or per step of a coordinate descent's path,
    from a plan's :meth:`Plan.to_dict` (also as a study publishes it)."""
    out = []
    for f in said["families"]:
        for s in f["axes"]:
            added = (f" (added {', '.join(format_value(v) for v in s['added'])})"
                     if s["added"] else "")
            best = format_value((f["best"] or {}).get(s["axis"]))
            if f["state"] == "running":
                text = "waiting for its runs"
            elif f["state"] == "no result":
                text = "no finished run"
            elif s["edge"] is None:
                text = f"bracketed, best {best}"
            else:
                text = f"NOT bracketed: best {best} at the {s['edge']} edge, {s['stopped']}"
            out.append(f"{f['label']}: {s['axis']} ({s['scale']}) {text}{added}")
    for i, step_ in enumerate(said["path"]):
        moved = "start" if step_["axis"] is None else f"moved on {step_['axis']}"
        value = "no result" if step_["value"] is None else f"{step_['value']:.4g}"
        out.append(f"{i}. {moved}: {Point(tuple(step_['point'].items())).key} → {value}")
    if said["state"]:
        out.append(f"coordinate descent: {said['state']}")
    return out


def _families(spec: SweepSpec) -> list[Family]:
    bracketed = set(spec.bracket.axes) if spec.bracket is not None else set()
    out: dict[tuple, Family] = {}
    for i, block in enumerate(spec.grid):
        axes = [a for a in block if a in bracketed and len(set(block[a])) >= 2]
        others = [a for a in block if a not in axes]
        for values in product(*(block[a] for a in others)):
            fixed = dict(zip(others, values, strict=True))
            key = (i, tuple(fixed.items()))
            out.setdefault(key, Family(i, fixed, {a: sorted(set(block[a])) for a in axes}))
    return list(out.values())


def _valid(spec: SweepSpec, axis: str, value: Any, scale: str) -> str | None:
    """Why ``value`` leaves ``axis``' valid range (``bracket.bounds``, log scale), or None."""
    if scale == "log" and value <= 0:
        return f"{format_value(value)} is not > 0"
    low, high = (spec.bracket.bounds.get(axis) or (None, None))
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{format_value(value)} leaves bracket.bounds {[low, high]}"
    return None


def grid_plan(spec: SweepSpec, results: Results, check: Check | None = None) -> Plan:
    """The grid's points, grown by bracketing (module docstring) as far as ``results`` go."""
    order = spec.axes()
    points = {p.key: p for p in spec.points()}
    families = _families(spec) if spec.bracket is not None else []
    finished = True
    for family in families:
        scales = {a: spacing(v, spec.bracket.scale.get(a, "auto"))
                  for a, v in family.axes.items()}
        family.status = [AxisStatus(a, scales[a]) for a in family.axes]
        status = {s.axis: s for s in family.status}
        while True:
            members = family.points(order)
            for p in members:
                points.setdefault(p.key, p)
            if any(p.key not in results for p in members):
                family.state, finished = "running", False
                break
            family.best = _best(members, results, spec.objective.direction)
            if family.best is None:
                family.state = "no result"
                break
            family.best_value = mean(results[family.best.key])
            best = family.best.as_dict()
            grown = False
            for axis, values in family.axes.items():
                s = status[axis]
                s.edge = ("low" if best[axis] == min(values) else
                          "high" if best[axis] == max(values) else None)
                if s.edge is None:
                    continue
                if len(s.added) >= spec.bracket.max_extensions:
                    s.stopped = f"max_extensions={spec.bracket.max_extensions} spent"
                    continue
                value = step(values, s.edge, s.scale)
                why = _valid(spec, axis, value, s.scale)
                if why is None and check is not None:
                    probe = Point(tuple((a, value if a == axis else v)
                                        for a, v in family.best.items))
                    why = check(probe)
                if why is not None:
                    s.stopped = f"next value not tried: {why}"
                    continue
                values.append(value)
                values.sort()
                s.added.append(value)
                s.stopped = ""
                grown = True
            if not grown:
                family.state = "edge" if any(s.edge for s in family.status) else "bracketed"
                break
    return Plan(list(points.values()), finished, families=families)


# ------------------------------------------------------------------------ coordinate descent
def coordinate_plan(spec: SweepSpec, results: Results) -> Plan:
    """The points of a coordinate descent (module docstring) as far as ``results`` go."""
    search = spec.search
    axes = list(search.params)
    direction = spec.objective.direction
    current = Point(tuple((a, search.start[a]) for a in axes))
    points = {current.key: current}
    plan = Plan([], False, state="running")
    if current.key not in results:
        plan.points = [current]
        return plan
    plan.path.append((None, current, mean(results[current.key])))
    for _ in range(search.max_cycles):
        moved = False
        for axis in axes:
            values = list(dict.fromkeys([*search.params[axis].values, current.as_dict()[axis]]))
            sweep = [Point(tuple((a, v if a == axis else x) for a, x in current.items))
                     for v in values]
            for p in sweep:
                points.setdefault(p.key, p)
            if any(p.key not in results for p in sweep):
                plan.points = list(points.values())
                return plan
            best = _best([current, *sweep], results, direction)
            if best is not None and _improves(score(results[best.key], direction),
                                              score(results[current.key], direction),
                                              search.threshold):
                current, moved = best, True
                plan.path.append((axis, current, mean(results[current.key])))
        if not moved:
            plan.state = "converged"
            break
    else:
        plan.state = f"max_cycles={search.max_cycles} reached"
    plan.points, plan.finished = list(points.values()), True
    return plan


def _improves(new: float | None, old: float | None, threshold: float) -> bool:
    """Whether score ``new`` beats ``old`` by more than ``threshold`` of ``|old|``."""
    if new is None:
        return False
    if old is None or math.isinf(old):
        return math.isfinite(new)
    return old - new > threshold * abs(old)


def make_plan(spec: SweepSpec, results: Results, check: Check | None = None) -> Plan:
    """The study's plan: :func:`coordinate_plan` or :func:`grid_plan` (an open TPE search has
    none: its sampler chooses)."""
    if spec.search is not None and spec.search.type == "coordinate":
        return coordinate_plan(spec, results)
    return grid_plan(spec, results, check)
