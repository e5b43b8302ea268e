"""Ablation and comparison tables as the paper prints them, in Markdown and LaTeX.

Each row (an optimizer, a MuonEq mode, …) is shown at its *own* best setting of the ``select``
axes (the learning rate, as the paper compares optimizers), chosen by the mean over seeds of the
table's first metric. Cells are ``mean ± std`` over seeds (sample standard deviation, n − 1),
the best mean of each column is bold, and each MuonEq variant shows its difference to its Muon
counterpart (MuonEq → Muon, MuonEq-Nes → Muon-Nes) on the first metric. Column groups (e.g.
model sizes) come from the ``columns`` axis.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from muoneq.registry import counterpart_of, optimizer_label
from muoneq.suite.sweeps.report_spec import MetricColumn, TableSpec
from muoneq.suite.sweeps.spec import format_value

#: short axis names for headers and titles
AXIS_NAMES = {"optimizer.lr": "lr", "optimizer.momentum": "momentum",
              "optimizer.ns_steps": "K", "optimizer.mode": "mode"}


def _norm(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def axis_name(axis: str) -> str:
    return AXIS_NAMES.get(axis, axis)


def setting_label(values: dict[str, Any], digits: int | None = None) -> str:
    """A human label: ``MuonEq-Nes (R)``, ``Muon-Nes | K=5``; floats to ``digits`` significant
    digits when given (a search's ``lr=0.0443``, not ``lr=0.044303752452182654``)."""
    parts = []
    opt = values.get("optimizer")
    if opt is not None:
        name = optimizer_label(opt)
        mode = values.get("optimizer.mode")
        parts.append(f"{name} ({mode})" if mode is not None else name)
    for axis, value in values.items():
        if (axis in ("optimizer", "optimizer.mode") and opt is not None) or value is None:
            continue
        shown = (f"{value:.{digits}g}" if digits is not None and isinstance(value, float)
                 else format_value(value))
        parts.append(f"{axis_name(axis)}={shown}")
    return " | ".join(parts) or "all runs"


@dataclass
class Cell:
    """One setting of the ``by`` axes: the metric over its seeds."""

    values: dict[str, Any]
    samples: list[float] = field(default_factory=list)
    seeds: list[Any] = field(default_factory=list)  #: the seed of each sample
    diverged: int = 0
    runs: list[dict] = field(default_factory=list)  #: the records of this setting, one per seed

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def run_dirs(self) -> list[str]:
        return [r["_run_dir"] for r in self.runs]

    @property
    def by_seed(self) -> dict[Any, float]:
        return dict(zip(self.seeds, self.samples, strict=True))

    @property
    def mean(self) -> float | None:
        """None when no seed reported the metric, or any seed diverged (an unstable
        setting: a non-finite value)."""
        if self.diverged or not self.samples:
            return None
        return statistics.fmean(self.samples)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.samples) if self.n > 1 and self.mean is not None else None


def cells(runs: Iterable[dict], by: Sequence[str], metric: str) -> dict[tuple, Cell]:
    """Group runs by the ``by`` axes (first-seen order) and collect ``metric`` per seed."""
    out: dict[tuple, Cell] = {}
    for run in runs:
        key = tuple(_norm(run.get(a)) for a in by)
        cell = out.setdefault(key, Cell(dict(zip(by, key, strict=True))))
        cell.runs.append(run)
        value = run.get(metric)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue  # this run's metrics.json does not report the metric
        if math.isfinite(value):
            cell.samples.append(float(value))
            cell.seeds.append(run.get("seed"))
        else:
            cell.diverged += 1
    return out


def better(a: float, b: float, direction: str) -> bool:
    return a < b if direction == "minimize" else a > b


def best_of(candidates: Iterable[Cell], direction: str) -> Cell | None:
    best = None
    for c in candidates:
        if c.mean is not None and (best is None or better(c.mean, best.mean, direction)):
            best = c
    return best


@dataclass
class TableEntry:
    cells: dict[str, Cell | None]  #: metric key → the cell at the selected setting
    selected: dict[str, Any]  #: select axis → chosen value
    delta: float | None = None  #: first metric minus the Muon counterpart's
    bold: set[str] = field(default_factory=set)  #: metric keys that are best in their column


@dataclass
class Table:
    name: str
    metrics: list[MetricColumn]
    directions: list[str]
    select: list[str]
    groups: list[Any]  #: values of the ``columns`` axis ([None]: a single group)
    rows: list[tuple[str, dict[str, Any], dict[Any, TableEntry]]]
    notes: list[str]


#: significant digits of a searched value in a row's label
SEARCH_DIGITS = 3


def build_table(runs: list[dict], spec: TableSpec, axes: Sequence[str], objective: str,
                direction: str, points_order: Sequence[dict], search: bool = False) -> Table:
    """Select each row's best setting per column group and collect its statistics. With
    ``search`` (a TPE study: every row is a point the sampler chose), rows are labelled to
    :data:`SEARCH_DIGITS` significant digits and sorted best first."""
    metrics = spec.metrics or [MetricColumn(key=objective)]
    directions = [m.direction or (direction if m.key == objective else "minimize")
                  for m in metrics]
    groups_axis = [spec.columns] if spec.columns else []
    row_axes = [a for a in axes if a not in spec.select and a not in groups_axis]
    by = [*row_axes, *groups_axis, *spec.select]
    stats = {m.key: cells(runs, by, m.key) for m in metrics}
    primary = stats[metrics[0].key]

    def ordered(axes_: list[str]) -> list[tuple]:
        seen: dict[tuple, None] = {}
        for point in points_order:
            seen.setdefault(tuple(_norm(point.get(a)) for a in axes_), None)
        return list(seen)

    groups = [g[0] for g in ordered(groups_axis)] if groups_axis else [None]
    rows, notes = [], []
    for row_key in ordered(row_axes):
        row_values = dict(zip(row_axes, row_key, strict=True))
        entries = {}
        for group in groups:
            prefix = row_key + ((group,) if groups_axis else ())
            candidates = [c for k, c in primary.items() if k[:len(prefix)] == prefix]
            best = best_of(candidates, directions[0])
            if best is None:
                entries[group] = TableEntry({m.key: None for m in metrics}, {})
                continue
            key = tuple(best.values[a] for a in by)
            selected = {a: best.values[a] for a in spec.select}
            entries[group] = TableEntry({m.key: stats[m.key].get(key) for m in metrics},
                                        selected)
            notes.extend(_edge_notes(row_values, group, selected, candidates, spec.select))
        rows.append((setting_label(row_values, SEARCH_DIGITS if search else None), row_values,
                     entries))
    if search:
        rows.sort(key=lambda row: _rank(row[2][groups[0]].cells.get(metrics[0].key),
                                        directions[0]))
    _mark_best(rows, groups, metrics, directions)
    if spec.deltas:
        _deltas(rows, groups, metrics[0].key)
    return Table(spec.name, metrics, directions, list(spec.select), groups, rows, notes)


def _rank(cell: Cell | None, direction: str) -> float:
    """A row's place, best first: its mean, negated when higher is better; no value last."""
    if cell is None or cell.mean is None:
        return math.inf
    return cell.mean if direction == "minimize" else -cell.mean


def _edge_notes(row_values, group, selected, candidates, select_axes) -> list[str]:
    """The grid must bracket each optimizer's best value: flag edge choices."""
    notes = []
    for axis in select_axes:
        grid = sorted({c.values[axis] for c in candidates if isinstance(c.values[axis],
                                                                       int | float)})
        value = selected[axis]
        if len(grid) >= 2 and value in (grid[0], grid[-1]):
            where = setting_label(row_values) + (f" [{group}]" if group is not None else "")
            notes.append(f"{where}: best {axis_name(axis)}={format_value(value)} is at the "
                         f"edge of its grid {[format_value(v) for v in grid]}; extend the grid")
    return notes


def _mark_best(rows, groups, metrics, directions) -> None:
    for group in groups:
        for metric, direction in zip(metrics, directions, strict=True):
            means = [(e[group].cells[metric.key].mean, e[group]) for _, _, e in rows
                     if e[group].cells[metric.key] is not None
                     and e[group].cells[metric.key].mean is not None]
            if not means:
                continue
            top = min(m for m, _ in means) if direction == "minimize" else max(
                m for m, _ in means)
            for m, entry in means:
                if m == top:
                    entry.bold.add(metric.key)


def baseline_row(rows, values: dict[str, Any], optimizer: str):
    """The row of ``optimizer`` that the row ``values`` is compared with: the first whose every
    axis it sets (besides the optimizer) has the row's value (Muon-Nes for MuonEq-Nes (R);
    AdamW, which sets no momentum or mode, for any row of its experiment). None if absent."""
    for row in rows:
        other = row[1]
        if other.get("optimizer") == optimizer and all(
                v is None or values.get(a) == v for a, v in other.items() if a != "optimizer"):
            return row
    return None


def _deltas(rows, groups, metric: str) -> None:
    for _, values, entries in rows:
        base = counterpart_of(values.get("optimizer"))
        counterpart = baseline_row(rows, values, base) if base else None
        if counterpart is None:
            continue
        for group in groups:
            mine, theirs = entries[group].cells[metric], counterpart[2][group].cells[metric]
            if mine and theirs and mine.mean is not None and theirs.mean is not None:
                entries[group].delta = mine.mean - theirs.mean


# ---------------------------------------------------------------------------------- rendering
def _number(value: float, metric: MetricColumn) -> str:
    return f"{value * metric.scale:.{metric.digits}f}"


def _selected_text(value: Any) -> str:
    if value is None:
        return "—"  # the axis does not apply to this row (e.g. momentum for AdamW)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _header(table: Table) -> list[str]:
    cols = ["Method"]
    for group in table.groups:
        prefix = f"{group} · " if group is not None else ""
        cols += [prefix + axis_name(a) for a in table.select]
        cols += [prefix + (m.label or m.key) for m in table.metrics]
    return cols


def to_markdown(table: Table) -> str:
    """GitHub Markdown: ``**94.57 ± 0.07** (+0.13)``; ``—`` where nothing finished."""
    lines = ["| " + " | ".join(_header(table)) + " |",
             "|" + "|".join([":--"] + ["--:"] * (len(_header(table)) - 1)) + "|"]
    for label, _, entries in table.rows:
        cells = [label.replace("|", "\\|")]
        for group in table.groups:
            entry = entries[group]
            cells += [_selected_text(entry.selected[a]) if a in entry.selected else "—"
                      for a in table.select]
            for i, metric in enumerate(table.metrics):
                cells.append(_md_cell(entry, metric, i == 0))
        lines.append("| " + " | ".join(cells) + " |")
    n = max((c.n for _, _, e in table.rows for g in table.groups
             for c in e[g].cells.values() if c is not None), default=0)
    caption = (f"Mean ± sample std over seeds (up to {n}); each row at its best "
               f"{', '.join(axis_name(a) for a in table.select) or 'setting'}; best in bold; "
               "(Δ) MuonEq variant minus its Muon counterpart.")
    return "\n".join(lines + ["", caption] + [f"- note: {n}" for n in table.notes]) + "\n"


def _md_cell(entry: TableEntry, metric: MetricColumn, primary: bool) -> str:
    cell = entry.cells.get(metric.key)
    if cell is None:
        return "—"
    if cell.mean is None:
        return f"diverged ({cell.diverged}/{cell.n + cell.diverged})" if cell.diverged else "—"
    text = _number(cell.mean, metric)
    if cell.std is not None:
        text += f" ± {_number(cell.std, metric)}"
    if metric.key in entry.bold:
        text = f"**{text}**"
    if primary and entry.delta is not None:
        text += f" ({entry.delta * metric.scale:+.{metric.digits}f})"
    return text


def _tex(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"),
                 ("#", r"\#"), ("±", r"$\pm$"), ("·", "")):
        text = text.replace(a, b)
    return text


def to_latex(table: Table) -> str:
    """A booktabs ``tabular`` with ``$94.57_{\\pm0.07}$`` cells, as in the paper's tables."""
    per_group = len(table.select) + len(table.metrics)
    spec = "l" + "c" * per_group * len(table.groups)
    out = [f"% {table.name}: generated by `muoneq report`", r"\begin{tabular}{" + spec + "}",
           r"\toprule"]
    if table.groups != [None]:
        heads, rules = ["Method"], []
        for i, group in enumerate(table.groups):
            heads.append(rf"\multicolumn{{{per_group}}}{{c}}{{{_tex(str(group))}}}")
            start = 2 + i * per_group
            rules.append(rf"\cmidrule(lr){{{start}-{start + per_group - 1}}}")
        out += [" & ".join(heads) + r" \\", " ".join(rules)]
        sub = [""]
        for _ in table.groups:
            sub += [_tex(axis_name(a)) for a in table.select]
            sub += [_tex(m.label or m.key) for m in table.metrics]
        out.append(" & ".join(sub) + r" \\")
    else:
        out.append(" & ".join(_tex(c) for c in _header(table)) + r" \\")
    out.append(r"\midrule")
    for label, _, entries in table.rows:
        cells = [_tex(label)]
        for group in table.groups:
            entry = entries[group]
            cells += [_tex(_selected_text(entry.selected[a]).replace("—", "--"))
                      if a in entry.selected else "--"
                      for a in table.select]
            for i, metric in enumerate(table.metrics):
                cells.append(_tex_cell(entry, metric, i == 0))
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(out) + "\n"


def _tex_cell(entry: TableEntry, metric: MetricColumn, primary: bool) -> str:
    cell = entry.cells.get(metric.key)
    if cell is None or cell.mean is None:
        return "diverged" if cell is not None and cell.diverged else "--"
    value = _number(cell.mean, metric)
    value = rf"\mathbf{{{value}}}" if metric.key in entry.bold else value
    std = f"_{{\\pm{_number(cell.std, metric)}}}" if cell.std is not None else ""
    text = f"${value}{std}$"
    if primary and entry.delta is not None:
        text += rf"\,{{\scriptsize({entry.delta * metric.scale:+.{metric.digits}f})}}"
    return text
