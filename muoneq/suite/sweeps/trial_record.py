"""What a study holds about each trial (its Optuna user attributes) and about itself (the
study's user attributes): the one description of that record, written by the driver
(:mod:`~muoneq.suite.sweeps.ledger`, :mod:`~muoneq.suite.sweeps.scheduler`,
:mod:`~muoneq.suite.sweeps.verdict`) and read by the driver and the report
(:mod:`muoneq.suite.report.records`).

A field's name is its user attribute's name; a field left at None is not written. Studies
made by earlier versions hold the same attributes (an attribute added later is None there).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from optuna.trial import BaseTrial

#: study user attributes: what may not change while the study goes on
#: (:func:`muoneq.suite.sweeps.study.study_fingerprint`), the sweep spec it runs (for the report),
#: what the plan added and why it stopped (:meth:`muoneq.suite.sweeps.plan.Plan.to_dict`), the
#: Optuna distribution of every search axis (:mod:`muoneq.suite.sweeps.distributions`), and the
#: point with the best mean objective over its seeds (:meth:`muoneq.suite.sweeps.ledger.Ledger.
#: publish_best`; Optuna's ``study.best_trial`` is the best single trial, one seed of a grid)
STUDY_FINGERPRINT, STUDY_SPEC, STUDY_PLAN, STUDY_DISTRIBUTIONS, STUDY_BEST = (
    "fingerprint", "spec", "plan", "distributions", "best_mean")

#: outcomes that use up a retry; ``diverged`` (non-finite objective) is a result, not a failure
FAILURES = ("failed", "timeout")


@dataclass
class TrialRecord:
    """The user attributes of one trial (see the module docstring). Besides these, a finished
    trial holds the objective and the metrics the report names as user attributes of their own
    names (``val/ppl``, ``step_time_s``: :meth:`muoneq.suite.sweeps.ledger.Ledger.tell`), so
    that ``study.trials_dataframe()`` has them as columns."""

    run_key: str | None = None  #: the run it runs (:mod:`muoneq.suite.sweeps.ledger`)
    point: dict[str, Any] | None = None  #: axis → value
    seeds: list[int] | None = None  #: one per run folder, in order
    #: the seed of a trial of one run (a grid's): a column of ``study.trials_dataframe()``
    seed: int | None = None
    run_dirs: list[str] | None = None  #: relative to the study folder
    driver: str | None = None  #: the driver that runs it (``host:pid:random``)
    host: str | None = None
    heartbeat: float | None = None  #: last sign of life of its driver (epoch seconds)
    attempt: int | None = None  #: 1 for the first attempt at its run
    retry_of: int | None = None  #: the failed trial it retries (its number)
    #: complete, diverged, pruned, interrupted, timeout, config_error, failed, skipped,
    #: abandoned (:class:`muoneq.suite.sweeps.verdict.Verdict`)
    outcome: str | None = None
    message: str | None = None  #: why it ended so (the process' last lines)
    metrics: dict[str, Any] | None = None  #: ``metrics.json`` (the mean over seeds)
    metrics_per_seed: list[dict[str, Any]] | None = None  #: a trial of several seeds
    #: seconds its processes ran, on the monotonic clock of the driver that started them (one
    #: machine's clock); None for runs it did not start (adopted, or told from a metrics.json)
    duration_s: float | None = None

    @classmethod
    def of(cls, trial: BaseTrial) -> TrialRecord:
        """The record a trial (frozen or running) holds; attributes of other names are
        ignored."""
        attrs = trial.user_attrs
        return cls(**{f.name: attrs[f.name] for f in fields(cls) if f.name in attrs})

    def attrs(self) -> dict[str, Any]:
        """The user attributes to write: every field that is set."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @property
    def skipped(self) -> bool:
        """A duplicate of a run another trial holds (never counted)."""
        return self.outcome == "skipped"

    @property
    def diverged(self) -> bool:
        return self.outcome == "diverged"

    def runs(self) -> list[tuple[int, dict[str, Any], str]]:
        """``(seed, metrics, run dir)`` of each of its runs that left ``metrics.json``."""
        per_seed = self.metrics_per_seed or [self.metrics or {}]
        return list(zip(self.seeds or [], per_seed, self.run_dirs or [], strict=False))
