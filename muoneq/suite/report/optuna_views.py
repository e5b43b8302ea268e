"""Optuna's own views of a study in the report: parameter importances and the slice and contour
plots of ``optuna.visualization.matplotlib``, for a study with two or more axes that vary.

They are drawn from in-memory studies of one trial per point, told the point's mean objective
over its seeds (a point with a diverged seed is left out), each axis in one distribution spanning
the values run (log where the study recorded it so, or where the values are log-spaced). So a
study made before trials carried Optuna params is drawn the same way; the stored study itself is
what ``optuna-dashboard`` and ``study.trials_dataframe()`` read.

* **Slices**: one figure per optimizer (``optuna_slice_<optimizer>.png``), the mean against each
  axis that varies within it, a categorical one (the mode) as categories.
* **Contours**: only between numeric axes (lr, momentum, K), one figure per setting of the
  categorical ones (an optimizer, a mode) where two or more numeric axes vary: a contour drawn
  across optimizers, or across modes that AdamW lacks, would interpolate between unrelated runs.
* **Importances**: PED-ANOVA over the point means, with its target the top 10 % of the points
  but at least 5 (Optuna's advice); a study of fewer than :data:`MIN_POINTS` points has none (its
  top 5 would be half of it).

Every numeric axis is labelled at the values run (Optuna's log axis has no label inside one
decade, and draws K as 4.0–5.0), at most :data:`MAX_LABELS` of them, with the fewest digits that
tell them apart (a TPE search's values are arbitrary floats).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import optuna
from matplotlib.ticker import FuncFormatter, NullLocator
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.importance import PedAnovaImportanceEvaluator

from muoneq.suite.files import slug
from muoneq.suite.report.figures import _save, panel_name
from muoneq.suite.report.records import StudyData
from muoneq.suite.report.tables import axis_name, cells, setting_label
from muoneq.suite.sweeps import distributions
from muoneq.suite.sweeps.plan import spacing

#: PED-ANOVA's target: the top 10 % of the points, and at least this many of them
TOP_SHARE, TOP_POINTS = 0.1, 5
#: points below which importances are not computed: the top 5 would be half of them
MIN_POINTS = 2 * TOP_POINTS
#: an axis with at most this many values run is labelled at values run
MAX_TICKS = 12
#: labels on a panel's axis at most (3.4 inches wide: more would overlap)
MAX_LABELS = 6


@dataclass
class OptunaViews:
    axes: list[str]  #: the axes that vary
    families: list[Family]  #: per optimizer: its points, axes and importances
    points: int  #: the points (mean over seeds) the views are drawn from
    files: list[Path]
    note: str = ""  #: why a view is missing


@dataclass(frozen=True)
class PointMean:
    values: dict  #: axis → value
    mean: float  #: the objective's mean over the point's seeds


def point_means(data: StudyData) -> tuple[list[PointMean], list[str], int]:
    """Every point's mean objective over its seeds, the axes that vary among them, and how many
    points were left out (a seed diverged)."""
    found = cells(data.runs, data.axes, data.objective).values()
    points = [PointMean({a: v for a, v in c.values.items() if v is not None}, c.mean)
              for c in found if c.mean is not None]
    return points, _varying(points, data.axes), sum(1 for c in found if c.diverged)


def _numeric(values: Sequence) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _distribution(values: list, recorded: BaseDistribution | None) -> BaseDistribution:
    """One distribution over ``values`` (log when the study recorded it so, or when the values
    are log-spaced)."""
    if not _numeric(values):
        return CategoricalDistribution(list(dict.fromkeys(values)))
    if all(isinstance(v, int) for v in values) and not isinstance(recorded, FloatDistribution):
        return IntDistribution(min(values), max(values))
    distinct = sorted(set(values))
    log = recorded.log if isinstance(recorded, FloatDistribution) else (
        len(distinct) > 1 and distinct[0] > 0 and spacing(distinct, "auto") == "log")
    return FloatDistribution(float(min(values)), float(max(values)), log=log)


def _varying(points: list[PointMean], axes: Sequence[str]) -> list[str]:
    return [a for a in axes if len({repr(p.values.get(a)) for p in points
                                     if a in p.values}) >= 2]


def point_study(points: list[PointMean], axes: Sequence[str], data: StudyData) -> optuna.Study:
    """An in-memory study of one trial per point (its ``axes`` as params), told its mean."""
    saved = distributions.from_json(data.distributions)
    dists = {a: _distribution([p.values[a] for p in points if a in p.values], saved.get(a))
             for a in axes}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory"
    try:
        study = optuna.create_study(direction=data.direction)
    finally:
        optuna.logging.set_verbosity(verbosity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([data.objective])
    for p in points:
        params = {a: p.values[a] for a in axes if a in p.values}
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={a: dists[a] for a in params}, value=p.mean))
    return study


def families(points: list[PointMean], by: Sequence[str]) -> dict[str, list[PointMean]]:
    """The points grouped by their values of the ``by`` axes, by label (``MuonEq-Nes (R)``)."""
    out: dict[str, list[PointMean]] = {}
    for p in points:
        out.setdefault(setting_label({a: p.values.get(a) for a in by}), []).append(p)
    return out


def _label_axes(fig, points: list[PointMean]) -> None:
    """Label each param axis of Optuna's figure at the values run (when few): a log axis inside
    one decade gets no label from Optuna, an int axis (K) is drawn as 4.0–5.0; a categorical
    axis is labelled without the quotes Optuna adds."""
    for ax in fig.axes:
        for axis, label in ((ax.xaxis, ax.get_xlabel()), (ax.yaxis, ax.get_ylabel())):
            values = sorted({p.values[label] for p in points if label in p.values}, key=repr)
            if not values:
                continue
            if _numeric(values) and len(values) <= MAX_TICKS:
                values = _thinned(sorted(values), axis.get_scale() == "log")
                axis.set_ticks(values, _tick_labels(values))
                axis.set_minor_locator(NullLocator())
            elif _numeric(values):  # a search's values: a few round ticks, short labels
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
                axis.set_minor_locator(NullLocator())
            elif not _numeric(values):
                ticks = axis.get_ticklocs()
                axis.set_ticks(ticks, [t.get_text().strip("'") for t in axis.get_ticklabels()])
            axis.set_label_text(axis_name(label))


def _tick_labels(values: Sequence[float]) -> list[str]:
    """The shortest labels that tell ``values`` apart: 2, then 3 significant digits (a TPE
    search's 0.0123456 is "0.012"), up to ``g``'s 6."""
    for digits in (2, 3, 6):
        labels = [f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _thinned(values: list[float], log: bool) -> list[float]:
    """The sorted ``values`` that are at least a :data:`MAX_LABELS`-th of the axis apart (on a
    log axis in log space), both ends kept: labels at every value of a search's dozen, close
    together, would overlap."""
    place = [math.log(v) for v in values] if log and values[0] > 0 else list(values)
    gap = (place[-1] - place[0]) / MAX_LABELS
    keep = [0]
    for j in range(1, len(values)):
        if place[j] - place[keep[-1]] >= gap:
            keep.append(j)
    if keep[-1] != len(values) - 1:  # the last value replaces the kept one too close to it
        keep[-1 if len(keep) > 1 else len(keep):] = [len(values) - 1]
    return [values[j] for j in keep]


def _make_room(fig, name: str, n_axes: int) -> None:
    """Optuna draws its n×n contour grid (1×n slices; one contour of two axes) at one fixed
    figure size: from three axes on, axis names and labels of neighbouring panels run into
    each other, and a panel is wider than TensorBoard's card (``TENSORBOARD_CARD_PX``). Give
    each panel a fixed size and slant the x tick labels."""
    cols = 1 if name == "contour" and n_axes == 2 else n_axes
    rows = cols if name == "contour" else 1
    fig.set_size_inches(3.4 * cols + 1.2, 3.0 * rows + 0.8)
    for ax in fig.axes:
        for label in ax.get_xticklabels():
            label.set_rotation(25)
            label.set_horizontalalignment("right")


def contour_panel(ax) -> str:
    """A contour panel's name in TensorBoard: its two axes."""
    return f"{ax.get_xlabel()} × {ax.get_ylabel()}"


def _method_colours(fig, points: list[PointMean], palette) -> None:
    """Optuna colours a slice's points by trial number, meaningless for point means: each
    point in its method's colour instead (optimizer and mode, as in every figure of the report:
    :class:`muoneq.suite.report.figures.Palette`), a legend of the methods, no colour bar.
    A panel's dots are found by the trial numbers Optuna colours them by (trial ``i`` is
    ``points[i]``, :func:`point_study`): a categorical panel draws them in category order, not
    in trial order."""
    for ax in list(fig.axes):
        if ax.get_ylabel() == "Trial":
            ax.remove()
            continue
        for dots in ax.collections:
            numbers = dots.get_array()
            if numbers is None:  # Optuna's (empty) infeasible trials
                continue
            dots.set_array(None)
            dots.set_facecolor([palette.colour(points[int(n)].values) for n in numbers])
    methods = {palette.method(p.values): palette.colour(p.values) for p in points}
    if len(methods) > 1:
        from matplotlib.lines import Line2D

        fig.axes[-1].legend(handles=[Line2D([], [], marker="o", linestyle="", color=c, label=m)
                                     for m, c in methods.items()], fontsize=8)
    left = min(ax.get_position().x0 for ax in fig.axes)
    right = max(ax.get_position().x1 for ax in fig.axes)
    fig.suptitle(fig.get_suptitle(), x=(left + right) / 2)


@dataclass
class Family:
    """The points of one optimizer (all points when the optimizer does not vary): its slice
    plot and its importances."""

    label: str
    points: list[PointMean]
    axes: list[str]  #: the axes that vary within it
    importances: dict[str, float]  #: axis → PED-ANOVA importance (empty: too few points)
    top: int  #: how many points PED-ANOVA's target holds (0: no importances)


def optimizer_families(data: StudyData, points: list[PointMean],
                       varying: list[str]) -> list[Family]:
    """One :class:`Family` per optimizer with an axis that varies within it."""
    out = []
    for label, group in families(points, ["optimizer"] if "optimizer" in varying else []).items():
        axes = _varying(group, [a for a in varying if a != "optimizer"])
        if axes:
            out.append(Family(label, group, axes, *importances(group, axes, data)))
    return out


def importances(points: list[PointMean], axes: list[str],
                data: StudyData) -> tuple[dict[str, float], int]:
    """PED-ANOVA importances of ``axes`` over the point means and the size of its target (the
    module docstring); ``({}, 0)`` for fewer than :data:`MIN_POINTS` points or one axis.
    Within one optimizer: across optimizers each has its own lr scale, so the lr would take the
    optimizer's share."""
    if len(points) < MIN_POINTS or len(axes) < 2:
        return {}, 0
    top = max(TOP_POINTS, math.ceil(TOP_SHARE * len(points)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's advice on small targets, followed above
        found = optuna.importance.get_param_importances(
            point_study(points, axes, data), params=axes,
            evaluator=PedAnovaImportanceEvaluator(target_quantile=top / len(points)))
    return found, top


def _plots(data: StudyData, points: list[PointMean], varying: list[str],
           found: list[Family], target: str) -> dict[str, tuple]:
    """``{file stem: (draw, points, axes, kind, label)}`` of the slices, importances and
    contours."""
    from optuna.visualization import matplotlib as views

    plots = {}
    for f in found:
        stem = "" if len(found) == 1 and "optimizer" not in varying else f"_{slug(f.label)}"
        study = point_study(f.points, f.axes, data)
        plots[f"optuna_slice{stem}"] = (
            lambda s=study, a=f.axes: views.plot_slice(s, params=a, target_name=target),
            f.points, f.axes, "slice", f.label)
        if f.importances:
            evaluator = PedAnovaImportanceEvaluator(target_quantile=f.top / len(f.points))
            plots[f"optuna_importances{stem}"] = (
                lambda s=study, a=f.axes, e=evaluator: views.plot_param_importances(
                    s, evaluator=e, params=a, target_name=data.objective),
                f.points, f.axes, "importances",
                f"{f.label}, top {f.top} of {len(f.points)} points")
    categorical = [a for a in varying if not _numeric([p.values[a] for p in points
                                                         if a in p.values])]
    numeric = [a for a in varying if a not in categorical]
    for label, group in families(points, categorical).items():
        axes = _varying(group, numeric)
        if len(axes) < 2:
            continue
        study = point_study(group, axes, data)
        stem = "optuna_contour" + (f"_{slug(label)}" if categorical else "")
        plots[stem] = (lambda s=study, a=axes: views.plot_contour(s, params=a,
                                                                  target_name=target),
                       group, axes, "contour", label)
    return plots


def write_views(data: StudyData, out_dir: Path, writer=None, palette=None) -> OptunaViews | None:
    """Slice, importance and contour plots (PNG, and TensorBoard images) of a study with two
    or more varying axes; None for a study with fewer."""
    from muoneq.suite.report.figures import Palette

    points, varying, diverged = point_means(data)
    if len(varying) < 2:
        return None
    palette = palette or Palette()
    found = optimizer_families(data, points, varying)
    notes = [f"{diverged} point(s) with a diverged seed left out"] if diverged else []
    none = [f"{f.label} ({len(f.points)} points)" for f in found if not f.importances]
    if none:
        notes.append(f"no importances for {', '.join(none)}: fewer than {MIN_POINTS} points "
                     f"or one axis (PED-ANOVA compares its top {TOP_POINTS} points with the "
                     "rest)")
    target = f"{data.objective}, mean over seeds " \
             f"({'lower' if data.direction == 'minimize' else 'higher'} is better)"
    files = []
    # Optuna's matplotlib views use pyplot and set its ggplot style globally: keep both local.
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt

        for stem, (draw, group, axes, kind, label) in _plots(data, points, varying, found,
                                                              target).items():
            drawn = draw()
            fig = (drawn.flat[0] if hasattr(drawn, "flat") else drawn).figure
            fig.suptitle(f"{kind.capitalize()}: {label}" if kind != "importances" else
                         f"PED-ANOVA importances of {data.objective}\n{label}")
            for ax in fig.axes:  # a panel's own "Slice Plot", "Hyperparameter Importances"
                for loc in ("left", "center", "right"):
                    ax.set_title("", loc=loc)
            if kind == "importances":
                fig.set_size_inches(4.6, 3.4)  # TENSORBOARD_CARD_PX (Optuna's: 6.4 × 4.8)
                ax = fig.axes[0]
                ax.set_yticks(ax.get_yticks(), [axis_name(t.get_text())
                                                for t in ax.get_yticklabels()])
                ax.set_ylabel("")
            else:
                _make_room(fig, kind, len(axes))
                _label_axes(fig, group)
            if kind == "slice":
                _method_colours(fig, group, palette)
                for ax in fig.axes:  # each panel readable alone, as TensorBoard shows it
                    ax.tick_params(labelleft=True)
            # the saved image in TensorBoard too: Optuna's layout would cut labels off
            tag = "optuna/" + stem.removeprefix("optuna_").replace("_", "/", 1)
            # a panel in TensorBoard: a slice by its axis, a contour by its two
            files.append(_save(fig, out_dir / f"{stem}.png", writer, tag, contour_panel
                               if kind == "contour" else panel_name))
            plt.close(fig)
    return OptunaViews(varying, found, len(points), files, "; ".join(notes))


def to_markdown(views: OptunaViews) -> str:
    lines = ["\n## Optuna's views\n",
             f"Drawn from the {views.points} points' means over their seeds: a slice plot per "
             "optimizer, a contour plot where two numeric axes vary within one optimizer (and "
             "mode), and, per optimizer, Optuna's PED-ANOVA importances: how differently each "
             "axis is distributed among its top points than among all of them (which axes its "
             "best points agree on; how much each setting changes the objective, the tables "
             "say).\n"]
    rated = [f for f in views.families if f.importances]
    axes = [a for a in views.axes if any(a in f.importances for f in rated)]
    if rated:
        lines += ["| optimizer | top points | " + " | ".join(map(axis_name, axes)) + " |",
                  "|:--|--:|" + "--:|" * len(axes)]
        lines += [f"| {f.label} | {f.top} of {len(f.points)} | " + " | ".join(
            f"{f.importances[a]:.2f}" if a in f.importances else "—" for a in axes) + " |"
            for f in rated]
    if views.note:
        lines.append(f"\n{views.note[0].upper()}{views.note[1:]}.")
    lines += [f"\n![{p.stem}]({p.name})" for p in views.files]
    return "\n".join(lines) + "\n"
