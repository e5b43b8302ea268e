"""How a trial ended, from what its processes left: Optuna's state, value and the attributes
the report reads.

The trial contract is ``metrics.json``, written by a run as its last act; the objective is its
key ``objective.metric`` (the mean over seeds when a trial runs several). A run that exits with
status 2 (:data:`CONFIG_ERROR_EXIT`) has a config, data or resume error the user must fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from optuna.trial import TrialState

from muoneq.suite.runtime.metrics import METRICS_FILE
from muoneq.suite.sweeps.launch import Outcome
from muoneq.suite.sweeps.trial_record import TrialRecord

#: a trial process that exits with this status has a config, data or resume error (``muoneq``
#: prints it as one line): retrying cannot help, the user must fix it
CONFIG_ERROR_EXIT = 2


@dataclass(frozen=True)
class Verdict:
    """What to tell Optuna: ``state``, the objective ``value`` (COMPLETE only), the trial's
    ``outcome`` (complete, diverged, pruned, interrupted, timeout, config_error or failed), a
    message and the trial's metrics (``record``)."""

    state: TrialState
    outcome: str
    value: float | None = None
    message: str = ""
    record: TrialRecord = field(default_factory=TrialRecord)
    missing_metric: bool = False  #: every run finished but metrics.json lacks the objective


def judge(outcomes: Sequence[Outcome], seeds: Sequence[int], metric: str) -> Verdict:
    """The verdict on a trial whose runs (one per seed, in order, stopping at the first that
    did not complete) ended in ``outcomes``."""
    last = outcomes[-1] if outcomes else Outcome("failed", message="nothing ran")
    per_seed = [o.metrics for o in outcomes if o.metrics is not None]
    ran = [o.seconds for o in outcomes if o.seconds is not None]
    record = TrialRecord(duration_s=sum(ran) if ran else None)
    if per_seed:
        record.metrics = per_seed[0] if len(seeds) == 1 else mean_metrics(per_seed)
        if len(seeds) > 1:
            record.metrics_per_seed = per_seed
    if last.status != "complete" or len(outcomes) < len(seeds):
        status = last.status if last.status in ("pruned", "interrupted", "timeout") else (
            "config_error" if last.returncode == CONFIG_ERROR_EXIT else "failed")
        state = TrialState.PRUNED if status == "pruned" else TrialState.FAIL
        return Verdict(state, status, message=last.message, record=record)
    stopped = [m for m in per_seed if m.get("status") == "diverged"]
    if stopped:  # the run stopped itself on a NaN/inf loss or validation value
        return Verdict(TrialState.FAIL, "diverged", record=record,
                       message=f"diverged at step {stopped[0].get('diverged_at_step')}: "
                               f"{stopped[0].get('diverged')}")
    unmeasured = [m for m in per_seed if m.get(metric) is None]
    if unmeasured:
        # a retry would read the same file: the objective must be fixed (a config error)
        m = unmeasured[0]
        what = (f"no {metric!r} (objective.metric)" if metric not in m else
                f"{metric!r} = null (objective.metric: not measured by this run, or not finite)")
        numbers = [k for k, v in m.items() if isinstance(v, int | float) and
                   not isinstance(v, bool)]
        return Verdict(TrialState.FAIL, "config_error", record=record, missing_metric=True,
                       message=f"{METRICS_FILE} has {what}; it has numbers for: "
                               f"{', '.join(sorted(numbers))}")
    values = [m[metric] for m in per_seed]
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        return Verdict(TrialState.FAIL, "diverged", record=record, message=f"{metric} = {values}")
    return Verdict(TrialState.COMPLETE, "complete", value=sum(values) / len(values), record=record)


def mean_metrics(per_seed: Sequence[dict]) -> dict:
    """Mean over seeds of the numeric keys present in every seed's metrics."""
    keys = set.intersection(*(set(m) for m in per_seed))
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in per_seed]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals) / len(vals)
    return out
