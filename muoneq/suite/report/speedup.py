"""Token-efficiency speedups: the share of its baseline's tokens a candidate needs to reach the
baseline's final validation loss (the data ratio of Wen et al. 2025, "Fantastic Pretraining
Optimizers and Where to Find Them"), per seed pair, with a Student-t interval.

For each seed both rows of a comparison ran (each at its own best setting), the target is the
baseline's loss at its last validation (its final weights) and T its tokens there. Tokens are
global step × ``tokens_per_step`` of the run's ``metrics.json`` (optimizer steps for a task that
reports no tokens). The candidate's curve is followed to its first validation at or below the
target, and the crossing is interpolated linearly in log-tokens between that validation
``(t₁, L₁)`` and the one before ``(t₀, L₀)``:

    log t* = log t₀ + (L₀ − target) / (L₀ − L₁) · (log t₁ − log t₀)

The pair's share is t*/T; the shares' mean gets the interval of :mod:`muoneq.suite.report.paired`.
A pair gets no number when its candidate never reaches the target, is below it already at its
first validation, or crosses between two validations more than ``max_gap`` apart (the curves are
too coarse to interpolate): the report says which instead, and how to validate more often.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, LogLocator

from muoneq.suite.report.figures import Curve, Palette, _save, figure_name, mean_curve
from muoneq.suite.report.paired import Comparison, Interval
from muoneq.suite.report.tables import Cell
from muoneq.suite.sweeps.events import ScalarReader
from muoneq.suite.sweeps.report_spec import SpeedupSpec


def amount(x: float, unit: str) -> str:
    """``2.46M tokens``, ``150 steps``."""
    if unit == "steps":
        return f"{x:.4g} steps"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix} tokens"
    return f"{x:.3g} tokens"


def crossing(curve: Sequence[tuple[float, float]], target: float, max_gap: float,
             unit: str = "tokens") -> tuple[float | None, str | None]:
    """Where ``curve`` (``(x, loss)`` by increasing x > 0) first reaches ``target``, interpolated
    in log x: ``(x*, None)``, or ``(None, why not)``."""
    for i, (x, loss) in enumerate(curve):
        if loss > target:
            continue
        if i == 0:
            return None, (f"already below it at its first validation ({amount(x, unit)}): too "
                          "coarse to interpolate")
        x0, loss0 = curve[i - 1]
        if x / x0 - 1 > max_gap:
            return None, (f"crosses it between validations at {amount(x0, unit)} and "
                          f"{amount(x, unit)}, more than {max_gap:.0%} apart: too coarse to "
                          "interpolate")
        frac = (loss0 - target) / (loss0 - loss)
        return math.exp(math.log(x0) + frac * (math.log(x) - math.log(x0))), None
    if not curve:
        return None, "logged no validation"
    x, loss = curve[-1]
    return None, f"never reaches it (its last validation: {loss:.4g} at {amount(x, unit)})"


def _range(shares: Interval) -> str:
    """``81% (74–88%)``."""
    return f"{shares.mean:.0%} ({100 * shares.low:.0f}–{shares.high:.0%})"


@dataclass(frozen=True)
class Crossing:
    """One seed pair: where the candidate reaches the baseline's final loss."""

    seed: Any
    target: float  #: the baseline's loss at its last validation
    baseline_x: float  #: the baseline's tokens (or steps) there
    x: float | None  #: the candidate's tokens (or steps) at the target; None: see ``problem``
    problem: str | None = None

    @property
    def share(self) -> float | None:
        return None if self.x is None else self.x / self.baseline_x


@dataclass
class Speedup:
    comparison: Comparison
    tag: str
    unit: str  #: ``tokens`` or ``steps``
    crossings: list[Crossing]
    curves: tuple[Curve, Curve] | None  #: candidate's and baseline's mean over the pairs' seeds
    scales: tuple[float, float]  #: tokens per step of the candidate and the baseline (or 1)
    path: Path | None = None  #: the figure

    @property
    def shares(self) -> Interval | None:
        """The shares' mean and interval, when every pair has one."""
        shares = [c.share for c in self.crossings]
        if not shares or None in shares:
            return None
        return Interval(tuple(shares))

    def sentence(self) -> str:
        """``MuonEq-Nes (R) reaches Muon-Nes's final val/loss at 81% (74–88%) of its tokens
        (…)``, or why there is no number."""
        c = self.comparison
        head = f"{c.candidate} reaches {c.baseline}'s final {self.tag}"
        group = f"{c.group}: " if c.group is not None else ""
        head = group + head
        interval = self.shares
        if interval is not None:
            if interval.half_width is None:
                return f"{head} at {interval.mean:.0%} of its {self.unit} (n=1, no interval)."
            return (f"{head} at {_range(interval)} of its {self.unit} (mean and 95% interval "
                    f"over {interval.n} seed pairs).")
        if not self.crossings:
            return (f"{group}{c.candidate} vs {c.baseline}: no number (no seed has {self.tag} "
                    "curves of both).")
        parts = [f"seed {x.seed}: " + (f"{x.share:.0%}" if x.problem is None else
                                       f"target {x.target:.4g}, {x.problem}")
                 for x in self.crossings]
        hint = " Validate more often (task.val_every_n_steps)." if any(
            "too coarse" in (x.problem or "") for x in self.crossings) else ""
        return (f"{group}{c.candidate} vs {c.baseline}'s final {self.tag}: no number (not every "
                "seed pair has one); " + "; ".join(parts) + "." + hint)


def _curve(run: dict, tag: str) -> dict[int, float]:
    return {s: v for s, v in ScalarReader(run["_run_dir"]).scalars(tag).items() if s > 0}


def _tokens_per_step(cell: Cell) -> float | None:
    values = {r.get("tokens_per_step") for r in cell.runs}
    value = values.pop() if len(values) == 1 else None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def speedup(comparison: Comparison, metric: str, spec: SpeedupSpec) -> Speedup:
    """The crossings of one comparison: candidate and baseline at the cells the table chose."""
    mine = comparison.candidate_entry.cells.get(metric)
    theirs = comparison.baseline_entry.cells.get(metric)
    if mine is None or theirs is None:
        return Speedup(comparison, spec.tag, "steps", [], None, (1.0, 1.0))
    scales = (_tokens_per_step(mine), _tokens_per_step(theirs))
    unit = "tokens" if None not in scales else "steps"
    scales = scales if unit == "tokens" else (1.0, 1.0)
    theirs_by_seed = {r.get("seed"): r for r in theirs.runs}
    crossings, curves = [], ([], [])
    for run in mine.runs:
        base = theirs_by_seed.get(run.get("seed"))
        pair = (_curve(run, spec.tag), _curve(base, spec.tag)) if base is not None else ({}, {})
        if not (pair[0] and pair[1]):
            continue
        curves[0].append(pair[0])
        curves[1].append(pair[1])
        last = max(pair[1])
        target, baseline_x = pair[1][last], last * scales[1]
        x, problem = crossing([(s * scales[0], v) for s, v in pair[0].items()], target,
                              spec.max_gap, unit)
        crossings.append(Crossing(run.get("seed"), target, baseline_x, x, problem))
    means = (mean_curve(curves[0]), mean_curve(curves[1])) if crossings else None
    return Speedup(comparison, spec.tag, unit, crossings, means, scales)


def _values(entry) -> dict:
    """The axes of a table entry (from any of its cells)."""
    return next((c.values for c in entry.cells.values() if c is not None), {})


def figure(found: Speedup, out_dir: Path, writer=None, palette: Palette | None = None) -> Path:
    """Loss against tokens (log scale) of both rows, mean over the pairs' seeds with the min–max
    band, the baseline's final loss dashed, and each pair's crossing marked."""
    c = found.comparison
    fig = Figure(figsize=(4.8, 3.6), layout="constrained")  # figures.TENSORBOARD_CARD_PX
    ax = fig.add_subplot()
    style = (palette or Palette()).styles()
    for curve, scale, label, entry in zip(found.curves, found.scales,
                                          (c.candidate, c.baseline),
                                          (c.candidate_entry, c.baseline_entry), strict=True):
        xs = [s * scale for s in curve.steps]
        line, = ax.plot(xs, curve.mean, marker=".", markersize=4, label=label,
                        **style(_values(entry)))
        if curve.seeds > 1:
            ax.fill_between(xs, curve.low, curve.high, color=line.get_color(), alpha=0.2,
                            linewidth=0)
    target = statistics.fmean(x.target for x in found.crossings)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1,
               label=f"{c.baseline}'s final {found.tag} ({target:.4g})")
    reached = [x for x in found.crossings if x.x is not None]
    if reached:
        ax.plot([x.x for x in reached], [x.target for x in reached], "kx", markersize=9,
                markeredgewidth=2, label="crossing, per seed pair")
    shares = found.shares
    if shares is not None:
        note = (f"reaches it at {_range(shares)} of {c.baseline}'s {found.unit}\n"
                f"(mean, 95% interval over {shares.n} seed pairs)"
                if shares.half_width is not None else
                f"reaches it at {shares.mean:.0%} of {c.baseline}'s {found.unit} (n=1)")
    else:
        missing = sum(x.x is None for x in found.crossings)
        note = (f"no number: {missing} of {len(found.crossings)} seed pairs\n"
                "have no crossing (see the report)")
    ax.text(0.98, 0.97, note, transform=ax.transAxes, ha="right", va="top", fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "gray", "alpha": 0.9})
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    for axis_set in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis_set(EngFormatter(sep=""))  # 20k, 50k, 100k, 2M
    ax.set_xlabel(f"{found.unit} (log scale)")
    ax.set_ylabel(found.tag)
    seeds = len(found.crossings)
    group = f"{c.group}: " if c.group is not None else ""
    ax.set_title(f"{group}{c.candidate} vs {c.baseline}\n{found.tag}, mean over {seeds} seed"
                 + ("s, band: min–max" if seeds > 1 else ""), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower left")
    group = f"{c.group}_" if c.group is not None else ""
    name = figure_name(f"speedup_{group}{c.candidate}_vs_{c.baseline}")
    return _save(fig, out_dir / f"{name}.png", writer, f"speedup/{name}")


def speedups(comparisons: Sequence[Comparison], metric: str, spec: SpeedupSpec, out_dir: Path,
             table_name: str, writer=None, palette: Palette | None = None) -> list[Speedup]:
    """Every comparison's speedup, a figure for those with curves, and the crossings as CSV
    (``speedup_<table>.csv``)."""
    out = []
    for comparison in comparisons:
        found = speedup(comparison, metric, spec)
        if found.curves is not None:
            found.path = figure(found, out_dir, writer, palette)
        out.append(found)
    with (out_dir / f"speedup_{table_name}.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["comparison", "seed", "unit", "target", "baseline_final", "candidate_at_target",
                    "share", "problem"])
        for found in out:
            for x in found.crossings:
                w.writerow([found.comparison.label, x.seed, found.unit, repr(x.target),
                            repr(x.baseline_x), "" if x.x is None else repr(x.x),
                            "" if x.share is None else repr(x.share), x.problem or ""])
    return out


def to_markdown(found: Sequence[Speedup], spec: SpeedupSpec) -> str:
    if not found:
        return ""
    lines = [f"- {s.sentence()}" for s in found]
    return (f"\nToken efficiency ({spec.tag}): the share of the baseline's tokens the candidate "
            "needs to reach the baseline's final loss, per seed pair, interpolated in "
            "log-tokens between validations.\n\n" + "\n".join(lines) + "\n")
