"""Figures of a study: heatmaps and robustness, K / learning-rate sweeps, learning curves.

Each figure is saved as a PNG (and its numbers as CSV) and, when a TensorBoard writer is
given, logged as that image; its layout is constrained, so no label is cut off. Matplotlib's
object API is used (no pyplot state, no display). Conventions shared by every figure of a
report: one colour per method (optimizer and mode, :class:`Palette`), one number format per
figure (:func:`number_format`), markers where a curve has few points, and every colour scale
says which way is better.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.patches import Rectangle
from matplotlib.ticker import StrMethodFormatter

from muoneq.suite.files import slug
from muoneq.suite.report.tables import axis_name, best_of, better, cells, setting_label
from muoneq.suite.sweeps.events import ScalarReader
from muoneq.suite.sweeps.report_spec import CurveSpec, HeatmapSpec, LineSpec
from muoneq.suite.sweeps.spec import format_value


def figure_name(text: str) -> str:
    """A figure's file name (no suffix) from its title or tag."""
    return slug(text, empty="all")


def _tick(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell_ticks(values: Sequence) -> list[str]:
    """Tick labels of a heatmap's cells: as :func:`_tick`, but where one is longer than a
    narrow cell holds (``0.000125`` beside ``0.00025``), each float in the shorter of that and
    its scientific form (``1.25e-4``, ``2.5e-4``, ``1e-3``, ``0.01``)."""
    ticks = [_tick(v) for v in values]
    if max(map(len, ticks), default=0) <= 6:
        return ticks
    return [min(t, np.format_float_scientific(v, trim="-", exp_digits=1), key=len)
            if isinstance(v, float) else t for t, v in zip(ticks, values, strict=True)]


def _sorted_values(values) -> list:
    values = list(dict.fromkeys(values))
    try:
        return sorted(values)
    except TypeError:
        return values


#: a curve with at most this many points is drawn with a marker at each
FEW_POINTS = 30


class Palette:
    """One colour per method (optimizer and mode) across every figure of a report, in the
    order the methods are first met (``points``: the report's points, in the sweep's order);
    a figure's further series of one method (other K, other momentum) get other line styles."""

    STYLES = ("-", "--", ":", "-.")

    def __init__(self, points: Sequence[dict] = ()):
        self.colours: dict[str, str] = {}
        for values in points:
            self.colour(values)

    @staticmethod
    def method(values: dict) -> str:
        return setting_label({k: values.get(k) for k in ("optimizer", "optimizer.mode")
                         if values.get(k) is not None})

    def colour(self, values: dict) -> str:
        method = self.method(values)
        if method not in self.colours:
            cycle = colormaps["tab10" if len(self.colours) < 10 else "tab20"].colors
            self.colours[method] = to_hex(cycle[len(self.colours) % len(cycle)])
        return self.colours[method]

    def styles(self) -> Callable[[dict], dict]:
        """For one figure: ``style(values)`` → ``color`` and ``linestyle`` of a series."""
        seen: dict[str, int] = {}

        def style(values: dict) -> dict:
            method = self.method(values)
            seen[method] = seen.get(method, -1) + 1
            return {"color": self.colour(values),
                    "linestyle": self.STYLES[seen[method] % len(self.STYLES)]}

        return style


#: at most this many more decimals than three significant digits, to tell neighbours apart
MORE_DIGITS = 2


def number_format(values: Iterable[float],
                  neighbours: Iterable[tuple[float, float]] = ()) -> str:
    """One format spec for all ``values`` of a figure: fixed decimals, enough for three
    significant digits of the smallest magnitude (``9.87``, ``10.40``; ``0.0123``), and more
    (up to :data:`MORE_DIGITS`) until every pair of ``neighbours`` that differ print apart
    (11.06 and 11.12 side by side: not both "11.1")."""
    finite = [abs(v) for v in values if math.isfinite(v) and v != 0]
    if not finite:
        return ".2f"
    digits = min(6, max(0, 2 - math.floor(math.log10(min(finite)))))
    pairs = [(a, b) for a, b in neighbours if a != b and math.isfinite(a) and math.isfinite(b)]
    for extra in range(MORE_DIGITS + 1):
        if all(f"{a:.{digits + extra}f}" != f"{b:.{digits + extra}f}" for a, b in pairs):
            break
    return f".{digits + extra}f"


def better_note(direction: str) -> str:
    return "lower is better" if direction == "minimize" else "higher is better"


#: Pixels per inch of every figure: 10-point text is 17 pixels tall.
DPI = 120
#: TensorBoard's Images tab shows every image this many pixels wide (``tf-image-loader``:
#: ``width: 350px``, the image at ``width: 100%``), scaled up or down to it; its Time Series
#: tab fits an image into a card at least 335 pixels wide. What is drawn 1 inch wide there
#: is shown :data:`TENSORBOARD_CARD_PX` pixels wide: a figure of several panels goes there one
#: panel per image, and the figures are sized so that a panel is about 5 inches wide.
TENSORBOARD_CARD_PX = 350


def card_text_px(points: float, image_width_px: int) -> float:
    """How tall ``points``-point text of an image ``image_width_px`` wide, drawn at
    :data:`DPI`, is shown on TensorBoard's image card (10 pixels is small but legible)."""
    return points / 72 * DPI * TENSORBOARD_CARD_PX / image_width_px


def _panels(fig: Figure) -> list:
    """The figure's visible panels: its axes that hold data (not a colour bar)."""
    return [ax for ax in fig.axes
            if ax.get_visible() and ax.get_label() != "<colorbar>" and ax.has_data()]


def panel_name(ax) -> str:
    """A panel's name in TensorBoard: its title up to a colon, else its x label."""
    return ax.get_title().split(":")[0] or ax.get_xlabel()


def _panel_images(fig: Figure, name: Callable = panel_name) -> list[tuple[str, np.ndarray]]:
    """``(name, RGBA pixels)`` of every panel of ``fig`` drawn alone, at :data:`DPI` and cut
    to its own extent (title, tick labels, axis labels and legend; the figure's title, colour
    bar and other panels hidden), named by ``name`` (``/`` spelled ``_``: a tag's ``/`` groups
    TensorBoard's cards)."""
    panels = _panels(fig)
    names = [(name(ax) or f"panel {i + 1}").replace("/", "_") for i, ax in enumerate(panels)]
    shown = [a for a in fig.get_children() if a is not fig.patch and a.get_visible()]
    out = []
    try:
        for panel, label in zip(panels, names, strict=True):
            for artist in shown:
                artist.set_visible(artist is panel)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
            buffer.seek(0)
            out.append((label, imread(buffer)))
    finally:
        for artist in shown:
            artist.set_visible(True)
    return out


def _save(fig: Figure, path: Path, writer, tag: str, name: Callable = panel_name) -> Path:
    """Save ``fig`` as the PNG ``path`` and log it to TensorBoard under ``tag``: the saved
    pixels (``add_figure`` would draw the figure again, the slowest part of a report), or with
    several panels one image per panel, ``<tag>/<name(panel)>`` (:data:`TENSORBOARD_CARD_PX`)."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    if writer is not None:
        panels = _panels(fig)
        if len(panels) > 1:
            for panel, image in _panel_images(fig, name):
                writer.add_image(f"{tag}/{panel}", image, dataformats="HWC")
        else:
            writer.add_image(tag, imread(path), dataformats="HWC")
    return path


# ----------------------------------------------------------------------------------- heatmaps
def _best(values, direction: str) -> float:
    return min(values) if direction == "minimize" else max(values)


def within(grid: np.ndarray, reference: float, pct: float, direction: str) -> float:
    """Fraction of ``grid`` within ``pct`` % of ``reference`` (missing/diverged cells: outside)."""
    tol = pct / 100 * abs(reference)
    with np.errstate(invalid="ignore"):
        ok = grid <= reference + tol if direction == "minimize" else grid >= reference - tol
    return float((ok & np.isfinite(grid)).sum()) / grid.size


@dataclass
class HeatmapPanel:
    title: str
    values: dict[str, Any]  #: the panel's axes (optimizer, K, …)
    x: list[Any]
    y: list[Any]
    grid: np.ndarray  #: mean over seeds, shape (len(y), len(x)); NaN where missing/diverged
    path: Path  #: the figure of every panel (``heatmaps.png``)
    figure: Figure
    ax: Any  #: this panel's subplot of ``figure``
    csv: Path  #: this panel's numbers
    best: float  #: this panel's best cell (NaN when none finished)
    robustness: float  #: fraction of cells within x% of the best cell of all panels
    robustness_own: float  #: fraction of cells within x% of this panel's own best cell


#: the axes that make a method (:meth:`Palette.method`): a heatmap's column
METHOD_AXES = ("optimizer", "optimizer.mode")


def panel_layout(keys: Sequence[tuple], axes: Sequence[str]) -> dict[tuple, tuple[int, int]]:
    """Each panel's (row, column) in the figure, as the paper's Figure 8 lays them out: a
    column per method (the values of the panel ``axes`` among :data:`METHOD_AXES`; without
    them, of the first axis), a row per value of the others (K)."""
    by_column = [i for i, a in enumerate(axes) if a in METHOD_AXES] or [0][:len(axes)]
    column = [tuple(k[i] for i in by_column) for k in keys]
    row = [tuple(v for i, v in enumerate(k) if i not in by_column) for k in keys]
    columns, rows = list(dict.fromkeys(column)), list(dict.fromkeys(row))
    return {k: (rows.index(r), columns.index(c)) for k, c, r in zip(keys, column, row,
                                                                     strict=True)}


def heatmaps(runs: list[dict], spec: HeatmapSpec, axes: Sequence[str], metric: str,
             direction: str, out_dir: Path, writer=None) -> list[HeatmapPanel]:
    """Annotated heatmaps of ``metric`` over ``x × y``, one panel per value of the other axes,
    as one figure (``heatmaps.png``, the paper's Figure 8: :func:`panel_layout`) on one colour
    scale with one colour bar, each panel's numbers in ``heatmap_<panel>.csv``; and two
    robustness numbers per panel (the paper's "broader low-perplexity region" as numbers): the
    fraction of its grid within ``robustness_pct`` % of the best cell of all panels, and within
    that much of its own best cell (missing or diverged cells count as outside). A row run at
    fewer than two values of ``x`` or of ``y`` (AdamW has no momentum; a mode run at one
    momentum) is no heatmap and gets no panel."""
    panel_axes = [a for a in axes if a not in (spec.x, spec.y)]
    stats = {k: c for k, c in cells(runs, [*panel_axes, spec.x, spec.y], metric).items()
             if c.values[spec.x] is not None and c.values[spec.y] is not None}
    spans: dict[tuple, tuple[set, set]] = {}
    for key, c in stats.items():
        seen = spans.setdefault(key[:len(panel_axes)], (set(), set()))
        seen[0].add(c.values[spec.x])
        seen[1].add(c.values[spec.y])
    stats = {k: c for k, c in stats.items()
             if min(map(len, spans[k[:len(panel_axes)]])) >= 2}
    xs = _sorted_values(c.values[spec.x] for c in stats.values())
    ys = _sorted_values(c.values[spec.y] for c in stats.values())
    panels: dict[tuple, np.ndarray] = {}
    for key, c in stats.items():
        grid = panels.setdefault(key[:len(panel_axes)], np.full((len(ys), len(xs)), np.nan))
        grid[ys.index(c.values[spec.y]), xs.index(c.values[spec.x])] = (
            np.nan if c.mean is None else c.mean)
    finite = [v for g in panels.values() for v in g[np.isfinite(g)]]
    if not finite:
        return []
    vmin, vmax = min(finite), max(finite)
    best = _best(finite, direction)
    # one format for every cell of every panel, telling side-by-side cells apart
    fmt = number_format(finite, [pair for g in panels.values() for pair in
                                 (*zip(g[:, :-1].flat, g[:, 1:].flat, strict=True),
                                  *zip(g[:-1, :].flat, g[1:, :].flat, strict=True))])
    where = panel_layout(list(panels), panel_axes)
    rows, cols = (max(v[i] for v in where.values()) + 1 for i in (0, 1))
    # a panel within 5 inches (TensorBoard shows it alone: TENSORBOARD_CARD_PX): cells 0.6 inch
    # wide up to 5 columns, narrower beyond (a bracketed grid reaches 8), still holding "27.80"
    cell = min(0.6, 3.5 / len(xs))
    xticks, yticks = _cell_ticks(xs), _cell_ticks(ys)
    # 10-point digits are about 6 points wide: labels longer than a cell holds are slanted
    slant = {"rotation": 30, "ha": "right"} if 6 * len(max(xticks, key=len)) > 65 * cell else {}
    fig = Figure(figsize=(cols * (cell * len(xs) + 1.2) + 1.2, rows * (0.45 * len(ys) + 1.2) + 0.8),
                 layout="constrained")
    grid_axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    for ax in grid_axes.flat:
        ax.set_visible(False)  # a panel that no setting fills (K=4 of one optimizer only)
    out, image = [], None
    for key, grid in panels.items():
        values = dict(zip(panel_axes, key, strict=True))
        title = setting_label(values)
        ax = grid_axes[where[key]]
        ax.set_visible(True)
        # one colour map for both directions (dark: low values): its meaning never flips; the
        # colour bar and the title say which way is better, the best cell is framed
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=vmin, vmax=vmax,
                          origin="lower", aspect="auto")
        ax.set_xticks(range(len(xs)), xticks, **slant)
        ax.set_yticks(range(len(ys)), yticks)
        ax.tick_params(labelbottom=True, labelleft=True)
        ax.set_xlabel(axis_name(spec.x))
        ax.set_ylabel(axis_name(spec.y))
        ax.set_title(title, fontsize=11)
        own = grid[np.isfinite(grid)]
        own_best = _best(own, direction) if own.size else math.nan
        for (i, j), v in np.ndenumerate(grid):
            if not np.isfinite(v):
                ax.text(j, i, "×", ha="center", va="center", fontsize=10, color="gray")
                continue
            dark = (v - vmin) / max(vmax - vmin, 1e-12) < 0.55  # viridis is dark at the bottom
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=10,
                    color="white" if dark else "black")
            if v == own_best:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=2))
        csv_path = out_dir / f"heatmap_{figure_name(title)}.csv"
        _write_grid_csv(csv_path, spec, xs, ys, grid)
        out.append(HeatmapPanel(
            title, values, xs, ys, grid, out_dir / "heatmaps.png", fig, ax, csv_path, own_best,
            robustness=within(grid, best, spec.robustness_pct, direction),
            robustness_own=within(grid, own_best, spec.robustness_pct, direction)
            if own.size else 0.0))
    bar = fig.colorbar(image, ax=grid_axes, label=f"{metric} ({better_note(direction)})")
    bar.ax.yaxis.set_major_formatter(StrMethodFormatter(f"{{x:{number_format(finite)}}}"))
    fig.suptitle(f"{metric} over {axis_name(spec.x)} × {axis_name(spec.y)}, one colour scale "
                 f"({better_note(direction)}); framed: each panel's best cell")
    _save(fig, out_dir / "heatmaps.png", writer, "heatmaps")
    _robustness_figure(out, spec, metric, best, out_dir, writer)
    return out


def _write_grid_csv(path: Path, spec: HeatmapSpec, xs, ys, grid) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([f"{axis_name(spec.y)} \\ {axis_name(spec.x)}", *map(_tick, xs)])
        for y, row in zip(ys, grid, strict=True):
            w.writerow([_tick(y), *("" if not np.isfinite(v) else repr(float(v)) for v in row)])


def robustness_markdown(panels: Sequence[HeatmapPanel], spec: HeatmapSpec, metric: str,
                        direction: str) -> str:
    """The robustness table: each panel's share of cells within x % of the best cell of all
    panels, and within x % of its own best cell."""
    pct = f"{spec.robustness_pct:g}%"
    best = _best([p.best for p in panels if math.isfinite(p.best)], direction)
    lines = [f"| panel | best {metric} | cells within {pct} of the best of all panels "
             f"({best:.4g}) | cells within {pct} of the panel's own best |",
             "|:--|--:|--:|--:|"]
    for p in panels:
        n = p.grid.size
        title = p.title.replace("|", "\\|")
        lines.append(f"| {title} | {p.best:.4g} | {p.robustness:.0%} "
                     f"({round(p.robustness * n)}/{n}) | {p.robustness_own:.0%} "
                     f"({round(p.robustness_own * n)}/{n}) |")
    return "\n".join(lines) + "\n"


def _robustness_figure(panels, spec, metric, best, out_dir, writer) -> None:
    # within 5 inches up to 4 panels (TENSORBOARD_CARD_PX), room for the legend above the bars
    fig = Figure(figsize=(max(4.2, 0.6 * len(panels) + 2.2), 3.4), layout="constrained")
    ax = fig.add_subplot()
    positions = np.arange(len(panels))
    pct = f"{spec.robustness_pct:g}%"
    for shift, attr, color, label in (
            # grays: the report's colours are its methods' (Palette), these bars are no method
            (-0.2, "robustness", "0.35", f"within {pct} of the best of all panels "
                                         f"({best:.4g})"),
            (0.2, "robustness_own", "0.7", f"within {pct} of the panel's own best")):
        shares = [getattr(p, attr) for p in panels]
        bars = ax.bar(positions + shift, shares, 0.4, color=color, label=label)
        ax.bar_label(bars, [f"{round(v * p.grid.size)}/{p.grid.size}"
                            for v, p in zip(shares, panels, strict=True)], fontsize=8)
    ax.set_xticks(positions, [p.title for p in panels], rotation=20, ha="right")
    ax.set_ylim(0, 1.3)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_ylabel(f"fraction of {axis_name(spec.x)} × {axis_name(spec.y)} cells\n"
                  "(higher is better)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"Robustness of {metric} over {axis_name(spec.x)} × {axis_name(spec.y)}")
    _save(fig, out_dir / "robustness.png", writer, "robustness")


# -------------------------------------------------------------------------- K / lr sweep lines
@dataclass
class LineSeries:
    label: str
    x: list[Any]
    mean: dict[str, list[float]]  #: metric → mean per x (NaN where missing)
    std: dict[str, list[float]]
    values: dict[str, Any]  #: the series' axes
    color: str = ""  #: its colour in the figure (its method's: :class:`Palette`)


def line_plot(runs: list[dict], spec: LineSpec, axes: Sequence[str], objective: str,
              direction: str, out_dir: Path, writer=None,
              palette: Palette | None = None) -> tuple[list[LineSeries], Path]:
    """Metrics against ``spec.x`` (e.g. validation perplexity and step time against K, or
    against the learning rate), one line per setting of the remaining axes; at each x the
    ``select`` axes are set to their best value for the first metric."""
    metrics = spec.metrics or [objective]
    first_dir = direction if metrics[0] == objective else "minimize"
    series_axes = [a for a in axes if a != spec.x and a not in spec.select]
    by = [*series_axes, spec.x, *spec.select]
    stats = {m: cells(runs, by, m) for m in metrics}
    xs = _sorted_values(c.values[spec.x] for c in stats[metrics[0]].values())
    groups: dict[tuple, dict[Any, list]] = {}
    for key, c in stats[metrics[0]].items():
        groups.setdefault(key[:len(series_axes)], {}).setdefault(c.values[spec.x], []).append(c)
    series = []
    for skey, by_x in groups.items():
        mean = {m: [] for m in metrics}
        std = {m: [] for m in metrics}
        for x in xs:
            chosen = best_of(by_x.get(x, []), first_dir)
            for m in metrics:
                c = stats[m].get(tuple(chosen.values[a] for a in by)) if chosen else None
                mean[m].append(math.nan if c is None or c.mean is None else c.mean)
                std[m].append(math.nan if c is None or c.std is None else c.std)
        series.append(LineSeries(setting_label(dict(zip(series_axes, skey, strict=True))), xs,
                                 mean, std, dict(zip(series_axes, skey, strict=True))))
    fig = Figure(figsize=(4.4 * len(metrics), 3.6), layout="constrained")
    numeric = all(isinstance(x, int | float) for x in xs)
    n_seeds = sorted({c.n for c in stats[metrics[0]].values() if c.n})
    seeds = f"{'/'.join(map(str, n_seeds))} seed{'s' if n_seeds != [1] else ''}"
    palette = palette or Palette()
    for i, m in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        style = palette.styles()
        for s in series:
            pos = xs if numeric else list(range(len(xs)))
            mu, sd = np.array(s.mean[m]), np.nan_to_num(np.array(s.std[m]))
            line, = ax.plot(pos, mu, marker="o", label=s.label, **style(s.values))
            s.color = line.get_color()
            ax.fill_between(pos, mu - sd, mu + sd, color=line.get_color(), alpha=0.2,
                            linewidth=0)
        if spec.logx and numeric:
            ax.set_xscale("log")
        ax.set_xticks(xs if numeric else range(len(xs)), [_tick(x) for x in xs])
        if len(xs) > 4:  # a grid grown by bracketing: neighbouring labels would touch
            ax.tick_params(axis="x", labelrotation=35)
        ax.minorticks_off()
        ax.set_xlabel(axis_name(spec.x))
        ax.set_ylabel(f"{m} ({better_note(direction if m == objective else 'minimize')})")
        ax.set_title(f"{m}: mean ± std over {seeds}" if max(n_seeds, default=1) > 1
                     else f"{m} ({seeds})", fontsize=10)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    path = _save(fig, out_dir / f"{spec.name}.png", writer, f"lines/{spec.name}")
    with (out_dir / f"{spec.name}.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["series", axis_name(spec.x), *(f"{m}_{k}" for m in metrics
                                                   for k in ("mean", "std"))])
        for s in series:
            for j, x in enumerate(xs):
                w.writerow([s.label, _tick(x), *(v for m in metrics
                                                  for v in (s.mean[m][j], s.std[m][j]))])
    return series, path


# ------------------------------------------------------------------------------ learning curves
#: the share of the steps a curve figure's right panel shows, at the end of training
ZOOM_SHARE = 0.5


def _zoom_on_the_end(ax, plotted: dict[str, Curve], tag: str) -> None:
    """The last :data:`ZOOM_SHARE` of the steps on a scale of their own, where the methods
    differ (on the whole run's scale their final values, and bands, lie on one line)."""
    last = max(cv.steps[-1] for cv in plotted.values())
    first = min(cv.steps[0] for cv in plotted.values())
    start = last - ZOOM_SHARE * (last - first)
    values = [v for cv in plotted.values() for s, lo, hi in zip(cv.steps, cv.low, cv.high,
                                                                 strict=True)
              if s >= start for v in (lo, hi)]
    if last == first or not values:
        ax.set_visible(False)
        return
    low, high = min(values), max(values)
    pad = 0.05 * (high - low or abs(high) or 1.0)
    ax.set_xlim(start, last + 0.02 * (last - first))
    ax.set_ylim(low - pad, high + pad)
    ax.set_title(f"the last {ZOOM_SHARE:.0%} of the steps", fontsize=10)
    ax.set_xlabel("global step (optimizer steps)")
    ax.set_ylabel(tag)
    ax.grid(alpha=0.3)



@dataclass
class Curve:
    """One row's curve of a tag: the mean over seeds and the min–max band, by global step."""

    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: int


def mean_curve(curves: Sequence[dict[int, float]]) -> Curve:
    """The mean and the min–max band of several seeds' ``{global step: value}`` curves, at the
    steps every seed logged."""
    steps = sorted(set.intersection(*(set(cv) for cv in curves)))
    at = [[cv[s] for cv in curves] for s in steps]
    return Curve(steps, [statistics.fmean(v) for v in at], [min(v) for v in at],
                 [max(v) for v in at], len(curves))


@dataclass
class CurvePlot:
    path: Path
    figure: Figure
    curves: dict[str, Curve]  #: row label → its curve


def learning_curves(runs: list[dict], spec: CurveSpec, axes: Sequence[str], objective: str,
                    direction: str, out_dir: Path, writer=None,
                    palette: Palette | None = None) -> dict[str, CurvePlot]:
    """Each row (the axes other than ``select``) at its best setting: each TensorBoard tag
    against the global step, read from the trials' event files, as the mean over seeds with the
    min–max band (at the steps every seed logged). Labels and the title say how many seeds.
    Returns ``{tag: CurvePlot}`` for the tags some run logged."""
    rows = [a for a in axes if a not in spec.select]
    stats = cells(runs, [*rows, *spec.select], objective)
    chosen: dict[tuple, Any] = {}
    for key, c in stats.items():
        current = chosen.get(key[:len(rows)])
        if c.mean is not None and (current is None or better(c.mean, current.mean, direction)):
            chosen[key[:len(rows)]] = c
    palette = palette or Palette()
    out = {}
    for tag in spec.tags:
        fig = Figure(figsize=(7.4, 3.6), layout="constrained")  # TENSORBOARD_CARD_PX
        ax, zoom = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
        plotted: dict[str, Curve] = {}
        style = palette.styles()
        for key, c in chosen.items():
            curves = [ScalarReader(d).scalars(tag) for d in c.run_dirs]
            curves = [cv for cv in curves if cv]
            if not curves:
                continue
            curve = mean_curve(curves)
            steps = curve.steps
            sel = ", ".join(f"{axis_name(a)}={format_value(c.values[a])}" for a in spec.select
                            if c.values[a] is not None)
            label = setting_label(dict(zip(rows, key, strict=True))) + (f" ({sel})" if sel else "")
            few = len(steps) <= FEW_POINTS  # a marker at each point; one point is no line
            look = {"marker": "o" if few else None, "markersize": 6 if len(steps) == 1 else 3,
                    **style(c.values)}
            for target in (ax, zoom):
                line, = target.plot(steps, curve.mean, **look, label=(
                    f"{label}, {curve.seeds} seed" + ("s" if curve.seeds > 1 else "")
                    + (f", one point (step {steps[0]})" if len(steps) == 1 else "")))
                if curve.seeds > 1:
                    target.fill_between(steps, curve.low, curve.high, color=line.get_color(),
                                        alpha=0.15, linewidth=0)
            plotted[label] = curve
        if not plotted:
            continue
        seeds = sorted({cv.seeds for cv in plotted.values()})
        ax.set_title(f"{tag}: mean over {'/'.join(map(str, seeds))} seed"
                     f"{'s' if seeds != [1] else ''}"
                     + (", band: min–max" if max(seeds) > 1 else ""), fontsize=10)
        ax.set_xlabel("global step (optimizer steps)")
        values = [v for cv in plotted.values() for v in (*cv.low, *cv.high)]
        if all(len(cv.steps) == 1 for cv in plotted.values()):
            ax.text(0.5, 0.04, f"each run logged {tag} once: no curve, one point per row",
                    transform=ax.transAxes, ha="center", va="bottom", fontsize=9,
                    color="dimgray")
        if min(values) > 0 and max(values) > 10 * min(values):  # e.g. a perplexity from 200
            ax.set_yscale("log")  # to 6: on a linear axis the close curves would be one line
        ax.set_ylabel(tag + (" (log scale)" if ax.get_yscale() == "log" else ""))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        _zoom_on_the_end(zoom, plotted, tag)
        name = figure_name(tag)
        path = _save(fig, out_dir / f"curve_{name}.png", writer, f"curves/{name}")
        out[tag] = CurvePlot(path, fig, plotted)
    return out
