"""Studies in Optuna storage as ``muoneq sweep`` leaves them, without running any trial."""

from __future__ import annotations

from optuna.trial import TrialState, create_trial


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
