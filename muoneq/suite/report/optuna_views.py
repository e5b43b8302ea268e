"""Optuna's own views of a study in the report: parameter importances and the contour and slice
plots of ``optuna.visualization.matplotlib``, for a study with two or more axes that vary.

They are drawn from an in-memory copy of the study's finished trials whose params are the
points the trials hold (:class:`muoneq.suite.sweeps.trial_record.TrialRecord`), each axis in one
distribution spanning every value run. So a study made before trials carried Optuna params,
or one whose recorded distributions were widened by an edited sweep file, is drawn the same
way; the stored study itself is what ``optuna-dashboard`` and ``study.trials_dataframe()``
read.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import optuna
from matplotlib.image import imread
from matplotlib.ticker import NullFormatter
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from muoneq.suite.report.records import StudyData
from muoneq.suite.sweeps import distributions
from muoneq.suite.sweeps.plan import spacing
from muoneq.suite.sweeps.trial_record import TrialRecord


@dataclass
class OptunaViews:
    axes: list[str]  #: the axes that vary
    importances: dict[str, float]  #: axis → share of the objective's variance (PED-ANOVA)
    files: list[Path]
    note: str = ""  #: why a view is missing


def _distribution(values: list, recorded: BaseDistribution | None) -> BaseDistribution:
    """One distribution over ``values`` (log when the study recorded it so, or when the values
    are log-spaced)."""
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return CategoricalDistribution(list(dict.fromkeys(values)))
    if all(isinstance(v, int) for v in values) and not isinstance(recorded, FloatDistribution):
        return IntDistribution(min(values), max(values))
    log = recorded.log if isinstance(recorded, FloatDistribution) else (
        min(values) > 0 and spacing(values, "auto") == "log")
    return FloatDistribution(float(min(values)), float(max(values)), log=log)


def view_study(data: StudyData) -> tuple[optuna.Study, list[str]]:
    """An in-memory study of the finished trials (module docstring) and its varying axes."""
    done = [t for t in data.trials if t.state == TrialState.COMPLETE]
    points = [(t, TrialRecord.of(t).point or {}) for t in done]
    values = {a: [p[a] for _, p in points if p.get(a) is not None] for a in data.axes}
    axes = [a for a in data.axes if len({repr(v) for v in values[a]}) >= 2]
    saved = distributions.from_json(data.distributions)
    dists = {a: _distribution(values[a], saved.get(a)) for a in axes}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory"
    try:
        study = optuna.create_study(direction=data.direction)
    finally:
        optuna.logging.set_verbosity(verbosity)
    for t, point in points:
        params = {a: point[a] for a in axes if point.get(a) is not None}
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={a: dists[a] for a in params}, value=t.value))
    return study, axes


def _make_room(fig, name: str, n_axes: int) -> None:
    """Optuna draws its n×n contour grid (1×n slices) at one fixed figure size: from three axes
    on, axis names and category labels of neighbouring panels run into each other. Give each
    panel a fixed size and slant the x tick labels."""
    width, height = fig.get_size_inches()
    rows = n_axes if name == "optuna_contour" else 1
    fig.set_size_inches(max(width, 3.4 * n_axes + 1.5), max(height, 3.0 * rows + 0.8))
    for ax in fig.axes:
        for label in ax.get_xticklabels():
            label.set_rotation(25)
            label.set_horizontalalignment("right")


def write_views(data: StudyData, out_dir: Path, writer=None) -> OptunaViews | None:
    """Importances, contour and slice plots (PNG, and TensorBoard images) of a study with two
    or more varying axes; None for a study with fewer."""
    study, axes = view_study(data)
    if len(axes) < 2:
        return None
    from optuna.visualization import matplotlib as views

    target = f"{data.objective} ({'lower' if data.direction == 'minimize' else 'higher'} " \
             "is better)"
    files, importances, notes = [], {}, []
    try:
        importances = optuna.importance.get_param_importances(study, params=axes)
    except (ValueError, RuntimeError) as err:
        notes.append(f"parameter importances not computed: {err}")
    plots = {"optuna_contour": lambda: views.plot_contour(study, params=axes, target_name=target),
             "optuna_slice": lambda: views.plot_slice(study, params=axes, target_name=target)}
    if importances:
        plots["optuna_importances"] = lambda: views.plot_param_importances(
            study, params=axes, target_name=data.objective)
    # Optuna's matplotlib views use pyplot and set its ggplot style globally: keep both local.
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt

        for name, draw in plots.items():
            drawn = draw()
            first = drawn.flat[0] if hasattr(drawn, "flat") else drawn
            fig = first.figure
            if name != "optuna_importances":
                _make_room(fig, name, len(axes))
            for ax in fig.axes:  # log axes: Optuna's minor labels (2×10⁻¹ …) run into each other
                for axis in (ax.xaxis, ax.yaxis):
                    if axis.get_scale() == "log":
                        axis.set_minor_formatter(NullFormatter())
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
            if writer is not None:  # the saved image: Optuna's layout would cut labels off
                writer.add_image(f"optuna/{name.removeprefix('optuna_')}", imread(path),
                                 dataformats="HWC")
            plt.close(fig)
            files.append(path)
    return OptunaViews(axes, importances, files, "; ".join(notes))


def to_markdown(views: OptunaViews) -> str:
    lines = ["\n## Optuna's views\n",
             "Parameter importances (Optuna's PED-ANOVA: the share of the objective's variance "
             "among the best trials each axis explains), and its contour and slice plots over "
             f"{', '.join(views.axes)}.\n"]
    if views.importances:
        lines += ["| axis | importance |", "|:--|--:|"]
        lines += [f"| {a} | {v:.2f} |" for a, v in views.importances.items()]
    if views.note:
        lines.append(f"\n{views.note}")
    lines += [f"\n![{p.stem}]({p.name})" for p in views.files]
    return "\n".join(lines) + "\n"
