"""Studies in Optuna storage as ``muoneq sweep`` leaves them, without running any trial."""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial


def add_trial(study, point_cell, seed, value, *, state=TrialState.COMPLETE,
              outcome="complete") -> None:
    """Record the run ``(point, cell key) × seed`` with ``metrics = {"test_acc": value}`` and
    the user attributes the sweep driver writes."""
    point, cell = point_cell
    study.add_trial(create_trial(
        state=state, value=value if state == TrialState.COMPLETE else None,
        params={"cell": cell, "seed": seed},
        distributions={"cell": CategoricalDistribution([cell]),
                       "seed": CategoricalDistribution([seed])},
        user_attrs={"run_key": f"{cell} | seed={seed}", "point": point, "seeds": [seed],
                    "run_dirs": [f"trials/{cell.replace(' ', ',')}/seed{seed}"],
                    "metrics": {"test_acc": value}, "outcome": outcome}))
