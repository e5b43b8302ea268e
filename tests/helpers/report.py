"""Studies in Optuna storage as ``muoneq sweep`` leaves them, without running any trial."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState, create_trial

from muoneq.suite.sweeps import SweepSpec, load_sweep
from muoneq.suite.sweeps.spec import spec_to_dict
from muoneq.suite.sweeps.storage import open_storage


def stored_study(tmp_path: Path, sweep: dict) -> tuple[Path, SweepSpec, optuna.Study]:
    """The sweep file ``<tmp>/<study>.yaml`` of ``sweep``, its spec, and its empty study in the
    default journal under ``<tmp>/runs/`` with the spec saved, as ``muoneq sweep`` leaves it."""
    path = tmp_path / f"{sweep['study']}.yaml"
    path.write_text(yaml.safe_dump(sweep))
    spec = load_sweep(path)
    study = optuna.create_study(study_name=spec.study, direction=spec.objective.direction,
                                storage=open_storage(None, tmp_path / "runs" / spec.study))
    study.set_user_attr("spec", spec_to_dict(spec))
    return path, spec, study


def add_trial(study, point_cell, seed, value, *, state=TrialState.COMPLETE,
              outcome="complete", metrics: dict | None = None) -> str:
    """Record the run ``(point, cell key) × seed`` with ``metrics`` (default
    ``{"test_acc": value}``) and the user attributes the sweep driver writes; return its run
    folder, relative to the study's."""
    point, cell = point_cell
    run_dir = f"trials/{cell.replace(' ', ',')}/seed{seed}"
    study.add_trial(create_trial(
        state=state, value=value if state == TrialState.COMPLETE else None,
        params={}, distributions={},
        user_attrs={"run_key": f"{cell} | seed={seed}", "point": point, "seeds": [seed],
                    "run_dirs": [run_dir],
                    "metrics": metrics or {"test_acc": value}, "outcome": outcome}))
    return run_dir
