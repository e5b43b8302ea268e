"""A study's finished runs as records, read from the Optuna storage.

One record (a dict) per run: the search axes, ``seed``, every key of the run's ``metrics.json``, and
``_status`` (``complete`` or ``diverged``), ``_run_dir``, ``_trial``. Pruned, failed and skipped
trials are left out; should two finished trials exist for one run (possible only after a
storage-level race), the first is kept and the repeat reported in ``duplicates``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState

from muoneq.suite.sweeps.spec import (
    Point,
    SweepError,
    SweepSpec,
    load_sweep,
    shipped_sweep,
    spec_from_dict,
)
from muoneq.suite.sweeps.storage import JOURNAL_NAME, open_storage, storage_label
from muoneq.suite.sweeps.trial_record import (
    STUDY_DISTRIBUTIONS,
    STUDY_PLAN,
    STUDY_SPEC,
    TrialRecord,
)


@dataclass
class StudyData:
    spec: SweepSpec
    study_dir: Path
    runs: list[dict]
    duplicates: list[int] = field(default_factory=list)
    #: what the sweep's plan added and why it stopped, as its drivers published it
    #: (:meth:`muoneq.suite.sweeps.plan.Plan.to_dict`); None for a TPE search or a plain grid
    plan: dict | None = None
    #: the study's trials and its axes' recorded Optuna distributions (JSON), for Optuna's own
    #: views (:mod:`muoneq.suite.report.optuna_views`)
    trials: list[optuna.trial.FrozenTrial] = field(default_factory=list)
    distributions: dict | None = None

    @property
    def axes(self) -> list[str]:
        return self.spec.axes()

    @property
    def objective(self) -> str:
        return self.spec.objective.metric

    @property
    def direction(self) -> str:
        return self.spec.objective.direction


def runs_from_trials(spec: SweepSpec, trials: list[optuna.trial.FrozenTrial],
                     study_dir: Path) -> tuple[list[dict], list[int]]:
    rows, seen, duplicates = [], set(), []
    axes = spec.axes()
    # Runs in the sweep file's order of points (then seed), so tables and figures follow it.
    order = {p.key: i for i, p in enumerate(spec.points())} if spec.is_grid else {}
    for t in sorted(trials, key=lambda t: t.number):
        rec = TrialRecord.of(t)
        if not (t.state == TrialState.COMPLETE or rec.diverged):
            continue
        if rec.run_key in seen:
            duplicates.append(t.number)
            continue
        seen.add(rec.run_key)
        point = rec.point or {}
        for seed, metrics, rel in rec.runs():
            row = {a: point.get(a) for a in axes}
            row.update({"seed": seed, **metrics, "_status": rec.outcome or "complete",
                        "_run_dir": str(study_dir / rel), "_trial": t.number})
            rows.append(row)
    rows.sort(key=lambda r: (order.get(_point_key(axes, r), len(order)), r["seed"]))
    return rows, duplicates


def _point_key(axes: list[str], run: dict) -> str:
    return Point(tuple((a, run[a]) for a in axes if run.get(a) is not None)).key


def load_study_data(target: str | Path, *, storage: str | None = None,
                    runs_dir: str | Path = "runs") -> StudyData:
    """Read a study given its sweep file (``sweeps/x.yaml``, or the name of a shipped one:
    ``x``) or its folder (``runs/x``).

    With a sweep file, its ``report:`` section is used (edit it and re-run the report, no need
    to re-run the study); with a folder, the spec the study was run with (saved in storage).
    """
    target = Path(target)
    sweep = target if target.is_file() else None
    if sweep is None and not target.is_dir() and storage is None:
        sweep = shipped_sweep(target)
        if sweep is None:
            raise SweepError(f"{target}: neither a sweep file, a study folder nor the name of "
                             "a sweep muoneq ships (muoneq sweep --help lists them)")
    if sweep is not None:
        spec = load_sweep(sweep)
        study_dir = Path(runs_dir) / spec.study
        name = spec.study
    else:
        study_dir, name, spec = target, target.name, None
    if storage is None and not (study_dir / JOURNAL_NAME).exists():
        raise SweepError(f"no study at {study_dir / JOURNAL_NAME}; run `muoneq sweep` first, "
                         "or pass --storage / --runs-dir")
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage, study_dir))
    except KeyError:
        raise SweepError(f"study {name!r} not found in "
                         f"{storage_label(storage, study_dir)}") from None
    if spec is None:
        if STUDY_SPEC not in study.user_attrs:
            raise SweepError(f"study {name!r} was not made by `muoneq sweep` (no spec)")
        spec = spec_from_dict(study.user_attrs[STUDY_SPEC], source=f"study {name}")
    trials = study.get_trials(deepcopy=False)
    runs, duplicates = runs_from_trials(spec, trials, study_dir)
    return StudyData(spec, study_dir, runs, duplicates, study.user_attrs.get(STUDY_PLAN), trials,
                     study.user_attrs.get(STUDY_DISTRIBUTIONS))
