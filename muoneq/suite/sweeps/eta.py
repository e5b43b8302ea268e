"""When a sweep will end: the expected remaining wall time, from the trials finished so far.

Once some trials have finished, with ``t`` the mean wall time of those trials, ``p`` the trials
at work at once (the driver's workers, or the trials running now if more) and ``w`` the trials
left to finish of which ``r`` are running, each for ``e_i`` seconds so far::

    remaining = ((w − r) · t + Σ_i max(t − e_i, 0)) / p

No time is ever read off two clocks. A finished trial's wall time is the one its driver measured
on its own monotonic clock from the start of its processes to their end
(:attr:`~muoneq.suite.sweeps.trial_record.TrialRecord.duration_s`), not its start and end stamps
in the study, which the driver that started it and another that finished it (after the first
died) write from two machines' clocks; a trial its driver did not run (adopted, or recorded by an
earlier version) counts the ``wall_clock_s`` its runs measured themselves (``metrics.json``). A
running trial's ``e_i`` is known only on the machine that started it: its start is a time on
that machine's clock (and in its time zone), never compared with this one's. A trial running on
another machine counts as half done (``t − e_i = t / 2``).

``muoneq sweep``'s progress line (after every trial) and ``muoneq sweep --status`` say it.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from optuna.trial import FrozenTrial

from muoneq.suite.sweeps.trial_record import TrialRecord


@dataclass(frozen=True)
class Estimate:
    """The expected remaining wall time and what it rests on."""

    seconds: float
    trial_s: float  #: mean wall time of a finished trial
    measured: int  #: finished trials measured
    parallel: int  #: trials at work at once

    def describe(self) -> str:
        return (f"about {duration(self.seconds)} left ({self.parallel} at a time; a trial took "
                f"{duration(self.trial_s)} on average, {self.measured} measured)")


def duration(seconds: float) -> str:
    """``seconds`` as a reader takes it in: ``45 s``, ``12 min``, ``3.4 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def wall_time(trial: FrozenTrial) -> float | None:
    """A finished trial's wall time measured on one clock (module docstring), or None."""
    record = TrialRecord.of(trial)
    if record.duration_s is not None:
        return record.duration_s
    per_seed = record.metrics_per_seed or ([record.metrics] if record.metrics else [])
    runs = [metrics.get("wall_clock_s") for metrics in per_seed]
    if runs and all(isinstance(s, int | float) and not isinstance(s, bool) for s in runs):
        return float(sum(runs))
    return None


def estimate(finished: Iterable[FrozenTrial], running: Iterable[FrozenTrial], left: int,
             workers: int, here: str, now: datetime.datetime | None = None) -> Estimate | None:
    """The remaining wall time of a study with ``left`` trials to finish (``running`` among
    them) at ``workers`` at a time, from its ``finished`` trials, on the machine ``here`` (its
    host name; see the module docstring); None before any trial has finished, or when none is
    left."""
    took = [s for s in map(wall_time, finished) if s is not None]
    if not took or left <= 0:
        return None
    mean = statistics.fmean(took)
    now = now or datetime.datetime.now()
    running = [t for t in running if t.datetime_start is not None]

    def to_go(t: FrozenTrial) -> float:
        if TrialRecord.of(t).host not in (here, None):  # started on another machine's clock
            return mean / 2
        return max(mean - (now - t.datetime_start).total_seconds(), 0.0)

    in_progress = sum(to_go(t) for t in running[:left])
    parallel = max(workers, len(running), 1)
    queued = max(left - len(running), 0)
    return Estimate((queued * mean + in_progress) / parallel, mean, len(took), parallel)


def study_estimate(ledger, workers: int):
    """``(summary, estimate)`` of the study a :class:`~muoneq.suite.sweeps.ledger.Ledger` keeps:
    its counts and :func:`estimate` from its finished runs and those running under a live
    driver."""
    runs = ledger.survey().runs
    summary = ledger.summary(runs)
    finished = [t for state in runs.values() for t in state.done]
    running = [t for state in runs.values() for t in state.live]
    return summary, estimate(finished, running, summary.pending, workers, ledger.me.host)
