"""Paired comparisons over seeds: each row of a table against its baselines, with Student-t
confidence intervals.

A seed fixes a run's initial weights and the order of its batches whatever the optimizer (every
task initializes its network right after seeding and draws its data order from the seed alone;
``tests/test_paired_seeds.py``). Two optimizers' runs with the same seed therefore differ only in
the optimizer, and their difference is one *paired* sample: what varies from seed to seed (a
lucky initialization, an easy data order) cancels in it. Over the n seeds both rows ran, each at
its own best setting, the mean difference d̄ gets the interval

    d̄ ± t_{(1+c)/2, n-1} · s_d / √n        (s_d: sample standard deviation of the differences)

at confidence c = 95%. A difference is called *better* or *worse* only when its interval
excludes zero; one pair gives no interval and no verdict.

Baselines of a row: its Muon counterpart for a MuonEq variant (MuonEq-Nes → Muon-Nes), and
AdamW for every other optimizer, where the table has those rows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

from muoneq.registry import counterpart_of
from muoneq.suite.report.tables import (
    Cell,
    Table,
    TableEntry,
    _tex,
    axis_name,
    baseline_row,
)
from muoneq.suite.sweeps.report_spec import MetricColumn

CONFIDENCE = 0.95
#: the optimizer every other one is compared with (besides a MuonEq variant's Muon)
BASELINE = "adamw"


@dataclass(frozen=True)
class Interval:
    """The mean of ``values`` and its two-sided Student-t confidence interval."""

    values: tuple[float, ...]
    confidence: float = CONFIDENCE

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def half_width(self) -> float | None:
        """``t_{(1+c)/2, n-1} · s / √n``; None below two values (no interval)."""
        if self.n < 2:
            return None
        t = float(stats.t.ppf((1 + self.confidence) / 2, self.n - 1))
        return t * statistics.stdev(self.values) / math.sqrt(self.n)

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def verdict(self, direction: str) -> str | None:
        """``better`` / ``worse`` for a difference (candidate − baseline) of a metric to
        ``direction``, only when the interval excludes zero; otherwise None."""
        if self.half_width is None or self.low <= 0 <= self.high:
            return None
        return "better" if (self.mean < 0) == (direction == "minimize") else "worse"


def baselines_of(optimizer: str | None) -> list[str]:
    """The optimizers a row of ``optimizer`` is compared with, in this order."""
    if optimizer is None or optimizer == BASELINE:
        return []
    counterpart = counterpart_of(optimizer)
    return [*([counterpart] if counterpart is not None else []), BASELINE]


def paired_difference(candidate: Cell | None, baseline: Cell | None) -> Interval | None:
    """Candidate − baseline over the seeds both report (None when there is none)."""
    if candidate is None or baseline is None:
        return None
    mine, theirs = candidate.by_seed, baseline.by_seed
    common = sorted(s for s in mine if s in theirs)
    return Interval(tuple(mine[s] - theirs[s] for s in common)) if common else None


@dataclass
class Comparison:
    """One row of a table (at its best setting) against one of its baselines (at its own)."""

    candidate: str  #: row label, e.g. ``MuonEq-Nes (R)``
    baseline: str  #: row label, e.g. ``Muon-Nes``
    group: Any  #: the column group (None: the table has one)
    candidate_entry: TableEntry
    baseline_entry: TableEntry
    differences: dict[str, Interval | None]  #: metric key → paired difference over seeds

    @property
    def label(self) -> str:
        prefix = f"{self.group}: " if self.group is not None else ""
        return f"{prefix}{self.candidate} − {self.baseline}"


def comparisons(table: Table) -> list[Comparison]:
    """Every row against each of its baselines present in ``table``, per column group."""
    out = []
    for group in table.groups:
        for label, values, entries in table.rows:
            for optimizer in baselines_of(values.get("optimizer")):
                row = baseline_row(table.rows, values, optimizer)
                if row is None:
                    continue
                mine, theirs = entries[group], row[2][group]
                out.append(Comparison(label, row[0], group, mine, theirs, {
                    m.key: paired_difference(mine.cells.get(m.key), theirs.cells.get(m.key))
                    for m in table.metrics}))
    return out


# ---------------------------------------------------------------------------------- rendering
def _signed(value: float, metric: MetricColumn) -> str:
    """``+0.02``, ``-0.30``; ``+0.00`` for a value that rounds to zero from below."""
    return f"{round(value * metric.scale, metric.digits) + 0.0:+.{metric.digits}f}"


def _pairs(comparison: Comparison) -> int:
    return max((d.n for d in comparison.differences.values() if d is not None), default=0)


def difference_text(interval: Interval | None, metric: MetricColumn, direction: str,
                    n: int | None = None) -> str:
    """``-0.34 [-0.52, -0.16] **better**``; ``+0.30 (n=1, no interval)``; ``—`` without pairs.
    ``n``: the pairs of the row (a different count is spelled out)."""
    if interval is None:
        return "—"
    text = _signed(interval.mean, metric)
    if interval.half_width is None:
        return f"{text} (n={interval.n}, no interval)"
    text += f" [{_signed(interval.low, metric)}, {_signed(interval.high, metric)}]"
    if n is not None and interval.n != n:
        text += f" (n={interval.n})"
    verdict = interval.verdict(direction)
    return f"{text} **{verdict}**" if verdict == "better" else (
        f"{text} {verdict}" if verdict else text)


def _select_text(table: Table) -> str:
    return ", ".join(axis_name(a) for a in table.select) or "setting"


def to_markdown(table: Table, found: Sequence[Comparison]) -> str:
    """The paired-difference table (empty when the table has no baselines)."""
    if not found:
        return ""
    head = ["Candidate − baseline", "seed pairs",
            *(f"Δ {m.label or m.key} [95% CI]" for m in table.metrics)]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join([":--"] + ["--:"] * (len(head) - 1)) + "|"]
    for c in found:
        n = _pairs(c)
        cells = [c.label, str(n)] + [
            difference_text(c.differences[m.key], m, d, n)
            for m, d in zip(table.metrics, table.directions, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    caption = (f"Paired differences, candidate − baseline, each at its own best "
               f"{_select_text(table)}: mean over the seeds both ran [95% Student-t interval]; "
               "a seed fixes the initial weights and the batches, so each pair differs only in "
               "the optimizer. **better** / worse only where the interval excludes zero.")
    return "\n".join(["", *lines, "", caption]) + "\n"


def to_latex(table: Table, found: Sequence[Comparison]) -> str:
    """The paired-difference table as a booktabs ``tabular``: ``$-0.34\\,[-0.52, -0.16]$``,
    bold where better, followed by "(worse)" where worse (as the Markdown table says both)."""
    out = [f"% {table.name}: paired differences over seeds, generated by `muoneq report`; "
           "bold: better, (worse): worse, where the 95% interval excludes zero",
           r"\begin{tabular}{lc" + "c" * len(table.metrics) + "}", r"\toprule",
           " & ".join(["Candidate $-$ baseline", "pairs",
                       *(rf"$\Delta$ {_tex(m.label or m.key)}" for m in table.metrics)])
           + r" \\", r"\midrule"]
    for c in found:
        cells = [_tex(c.label.replace("−", "--")), str(_pairs(c))]
        for m, direction in zip(table.metrics, table.directions, strict=True):
            d = c.differences[m.key]
            if d is None:
                cells.append("--")
            elif d.half_width is None:
                cells.append(f"${_signed(d.mean, m)}$ (n={d.n})")
            else:
                text = f"{_signed(d.mean, m)}\\,[{_signed(d.low, m)}, {_signed(d.high, m)}]"
                verdict = d.verdict(direction)
                cells.append(rf"$\mathbf{{{text}}}$" if verdict == "better" else
                             f"${text}$ (worse)" if verdict == "worse" else f"${text}$")
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(out) + "\n"
