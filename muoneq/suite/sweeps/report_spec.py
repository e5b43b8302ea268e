"""The ``report:`` section of a sweep file: which tables, heatmaps, line plots and learning
curves ``muoneq report`` (:mod:`muoneq.suite.report`) writes (typed OmegaConf schema and its
checks).

The sweep file's schema (:mod:`muoneq.suite.sweeps.spec`) embeds this section as
``SweepSpec.report`` and checks it when the file is loaded, against the sweep's search axes
(:func:`check_report`); :func:`metrics_named` lists the ``metrics.json`` keys it names, which a
sweep checks before it runs anything (:mod:`muoneq.suite.sweeps.validate`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from omegaconf import MISSING

#: How a metric improves (a sweep's objective, a table's column).
DIRECTIONS = ("minimize", "maximize")


@dataclass
class MetricColumn:
    key: str = MISSING  #: key of metrics.json
    label: str | None = None
    scale: float = 1.0  #: e.g. 100 for accuracy in %
    digits: int = 2
    direction: str | None = None  #: default: the objective's for its metric, else minimize


@dataclass
class SpeedupSpec:
    """Token-efficiency speedups of a table's comparisons (muoneq.suite.report.speedup)."""

    tag: str = "val/loss"  #: TensorBoard scalar of a loss (lower is better), by global step
    #: a crossing is interpolated only between validations at most this far apart (as a
    #: fraction of the earlier one's tokens); farther: "too coarse", no number
    max_gap: float = 0.25


@dataclass
class TableSpec:
    name: str = "table"
    metrics: list[MetricColumn] = field(default_factory=list)  #: first one ranks the rows
    select: list[str] = field(default_factory=lambda: ["optimizer.lr"])  #: chosen at best
    columns: str | None = None  #: axis whose values become column groups (e.g. experiment)
    #: MuonEq variants against their Muon counterparts (the Δ in the cells), and every row
    #: against its baselines as paired differences over seeds with 95% intervals
    deltas: bool = True
    speedup: SpeedupSpec | None = None  #: token-efficiency speedups against the baselines


@dataclass
class HeatmapSpec:
    x: str = "optimizer.lr"
    y: str = "optimizer.momentum"
    metric: str | None = None  #: default: the objective metric
    robustness_pct: float = 5.0  #: a cell is "good" within this % of the best cell


@dataclass
class LineSpec:
    name: str = "lines"
    x: str = MISSING
    metrics: list[str] = field(default_factory=list)  #: default: the objective metric
    select: list[str] = field(default_factory=list)  #: chosen at best per series and x
    logx: bool = False


@dataclass
class CurveSpec:
    tags: list[str] = field(default_factory=list)  #: TensorBoard scalar tags
    select: list[str] = field(default_factory=lambda: ["optimizer.lr"])


@dataclass
class ReportSpec:
    tables: list[TableSpec] = field(default_factory=list)
    heatmaps: list[HeatmapSpec] = field(default_factory=list)
    lines: list[LineSpec] = field(default_factory=list)
    curves: CurveSpec | None = None


def check_report(report: ReportSpec, axes: Iterable[str]) -> None:
    """Raise ``ValueError`` naming the field when ``report`` refers to something other than
    one of the sweep's search ``axes`` or holds an invalid value."""
    axes = set(axes)

    def need(axis: str | None, where: str) -> None:
        if axis is not None and axis not in axes:
            raise ValueError(f"{where}={axis!r} is not a search axis; "
                             f"axes: {', '.join(sorted(axes)) or '(none)'}")

    for t in report.tables:
        for a in t.select:
            need(a, f"report.tables[{t.name}].select")
        need(t.columns, f"report.tables[{t.name}].columns")
        for m in t.metrics:
            if m.direction is not None and m.direction not in DIRECTIONS:
                raise ValueError(f"report.tables[{t.name}].metrics.direction={m.direction!r} is "
                                 f"invalid; allowed: {', '.join(DIRECTIONS)}")
        if t.speedup is not None and not t.speedup.max_gap > 0:
            raise ValueError(f"report.tables[{t.name}].speedup.max_gap must be > 0 "
                             f"(got {t.speedup.max_gap})")
    for h in report.heatmaps:
        need(h.x, "report.heatmaps.x")
        need(h.y, "report.heatmaps.y")
        if not 0 < h.robustness_pct < 100:
            raise ValueError("report.heatmaps.robustness_pct must be in (0, 100)")
    for line in report.lines:
        need(line.x, f"report.lines[{line.name}].x")
        for a in line.select:
            need(a, f"report.lines[{line.name}].select")
    if report.curves is not None:
        for a in report.curves.select:
            need(a, "report.curves.select")


def metrics_named(report: ReportSpec) -> dict[str, str]:
    """The ``metrics.json`` keys the report's tables, heatmaps and line plots name, each with
    the field that names it (the objective is the default where none is named)."""
    named: dict[str, str] = {}
    for t in report.tables:
        for m in t.metrics:
            named.setdefault(m.key, f"report.tables[{t.name}].metrics.key")
    for h in report.heatmaps:
        if h.metric is not None:
            named.setdefault(h.metric, "report.heatmaps.metric")
    for line in report.lines:
        for m in line.metrics:
            named.setdefault(m, f"report.lines[{line.name}].metrics")
    return named
