"""What a worker does next: a typed job, a wait, or nothing (the study is finished).

Under the driver's in-process lock, :meth:`Scheduler.next_job`

1. settles the orphans (trials whose driver died): a finished run is told its result, a live
   process on this machine is adopted (:class:`Adopt`), anything else is failed (and retried);
2. derives the plan from the finished runs (a grid grown by bracketing, a coordinate
   descent: :mod:`muoneq.suite.sweeps.plan`);
3. queues a retry for every run whose last attempt failed and that has retries left;
4. stops when every run is finished or out of retries (:data:`None`), waits while other workers
   hold the last runs (:class:`Wait`), or asks Optuna for a trial (:class:`Start`): a queued
   retry, the plan's first open run, or TPE's next configuration. A trial whose run is already
   finished or claimed by another trial (two drivers raced for it: see
   :meth:`~muoneq.suite.sweeps.ledger.Ledger.duplicate_of`) is told FAIL with ``outcome=skipped``
   and the next one is asked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from muoneq.suite.sweeps import launch
from muoneq.suite.sweeps.ledger import Ledger, RunState, grid_key, split_key
from muoneq.suite.sweeps.spec import Point
from muoneq.suite.sweeps.trial_record import TrialRecord
from muoneq.suite.sweeps.verdict import judge

log = logging.getLogger("muoneq.suite.sweeps")


@dataclass(frozen=True)
class Start:
    """A trial asked for this driver: run its point on each seed, in order."""

    trial: optuna.Trial
    point: Point
    seeds: tuple[int, ...]
    key: str

    @property
    def number(self) -> int:
        return self.trial.number


@dataclass(frozen=True)
class Adopt:
    """A trial whose driver died while its process lives on (this machine): wait for it."""

    number: int
    point: Point
    seeds: tuple[int, ...]
    key: str


@dataclass(frozen=True)
class Wait:
    """Other workers hold the last runs: look again later (they may die)."""


Job = Start | Adopt


class Scheduler:
    """Hands out the study's work to this driver's workers (see the module docstring)."""

    def __init__(self, ledger: Ledger, study_dir: Path):
        self.ledger, self.spec, self.me, self.study_dir = ledger, ledger.spec, ledger.me, study_dir

    def next_job(self) -> Job | Wait | None:
        """The next job, :class:`Wait`, or None when the study is finished (call it under the
        driver's lock: its reads and writes of the study are one step)."""
        while True:
            survey = self.ledger.survey()
            orphans = [(key, t) for key, state in survey.runs.items() for t in state.orphans]
            for key, t in orphans:
                adopted = self._settle_orphan(t, key)
                if adopted is not None:
                    return adopted
            if orphans:
                survey = self.ledger.survey()
            if self.spec.planned:
                self.ledger.replan(survey)
            queued = self._queue_retries(survey.runs)
            if not (queued or survey.unkeyed_waiting or self._fresh(survey.runs)
                    or any(s.waiting for s in survey.runs.values())):
                busy = any(s.live or s.orphans for s in survey.runs.values())
                return Wait() if busy else None
            job = self._ask()
            if job is not None:
                return job  # else the asked trial was a duplicate, told skipped: look again

    def _queue_retries(self, runs: dict[str, RunState]) -> bool:
        """Enqueue the parameters of every failed run with retries left; True if any."""
        queued = False
        planned = self.spec.planned
        keys = self.ledger.expected if planned else set(runs)  # not an old plan's
        for key in keys:
            state = runs.get(key)
            if state is not None and state.tried and self.ledger.is_open(state):
                last = state.tried[-1]
                self.ledger.study.enqueue_trial(
                    {} if planned else last.params,
                    user_attrs=TrialRecord(run_key=key, retry_of=last.number).attrs())
                queued = True
        return queued

    def _fresh(self, runs: dict[str, RunState]) -> bool:
        """Whether a run never tried remains: a planned run, or a TPE configuration."""
        if self.spec.planned:
            return self._next_open(runs) is not None
        return len(self.ledger.configs_started()) < self.spec.search.n_trials

    def _next_open(self, runs: dict[str, RunState]) -> str | None:
        """The plan's first run (in its order, then by seed) that needs an attempt."""
        for cell in self.ledger.points:
            for seed in self.spec.seeds:
                key = grid_key(cell, seed)
                if key not in runs or self.ledger.is_open(runs[key]):
                    return key
        return None

    def _ask(self) -> Start | None:
        """Ask a trial and claim its run; None when the run is taken (the trial is skipped)."""
        # The plan's first open run is found before asking, so that the claim follows the ask
        # at once: the shorter that gap, the rarer two racing drivers both pass the check.
        first_open = self._next_open(self.ledger.survey().runs) if self.spec.planned else None
        trial = self.ledger.study.ask()
        if self.spec.planned:
            # A queued retry names its run; else take the plan's first open one.
            key = TrialRecord.of(trial).run_key or first_open
            cell, seed = split_key(key) if key is not None else (None, 0)
            if cell not in self.ledger.points:
                self.ledger.tell(trial.number, TrialState.FAIL, outcome="skipped",
                                 message=f"{key or 'no run'} is not open in the plan")
                return None
            point, seeds = self.ledger.points[cell], (seed,)
        else:
            params = {}
            for name, p in self.spec.search.params.items():
                if p.type == "float":
                    params[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
                elif p.type == "int":
                    params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
                else:
                    params[name] = trial.suggest_categorical(name, list(p.choices))
            point, seeds = self.ledger.point_of(params), tuple(self.spec.seeds)
            key = point.key
        # The claim is written before looking for another, so of two racing drivers at least one
        # sees the other's: exactly one goes on (duplicate_of), and the ``driver`` attribute,
        # written below, marks the one that did.
        self.ledger.write(trial.number, TrialRecord(run_key=key))
        duplicate = self.ledger.duplicate_of(trial.number, key)
        if duplicate is not None:
            self.ledger.tell(trial.number, TrialState.FAIL, outcome="skipped",
                             message=f"duplicate of trial {duplicate}")
            log.info("trial %d: %s is already taken by trial %d; skipped",
                     trial.number, key, duplicate)
            return None
        if self.spec.planned:  # a TPE trial has its params from its sampler
            self.ledger.set_params(trial.number, point)
        runs = self.ledger.survey().runs.get(key, RunState())
        dirs = [str(point.run_dir(self.study_dir, s).relative_to(self.study_dir)) for s in seeds]
        self.ledger.write(trial.number, TrialRecord(
            point=point.as_dict(), seeds=list(seeds), seed=seeds[0] if len(seeds) == 1 else None,
            run_dirs=dirs, driver=self.me.id,
            host=self.me.host, heartbeat=time.time(), attempt=runs.failures + 1))
        return Start(trial, point, seeds, key)

    def _settle_orphan(self, t: FrozenTrial, key: str) -> Adopt | None:
        """A trial whose driver died: tell its result, adopt its live process, or fail it."""
        point, rec = self.ledger.point_of_trial(t), TrialRecord.of(t)
        seeds = tuple(rec.seeds or ())
        dirs = [self.study_dir / d for d in rec.run_dirs or []]
        if point is None or not dirs:
            self.ledger.tell(t.number, TrialState.FAIL, outcome="failed",
                             message="its driver died before launching it")
            return None
        if all(launch.read_metrics(d) is not None for d in dirs):
            log.info("trial %d (%s): driver gone, run finished: telling its result",
                     t.number, key)
            outcomes = [launch.Outcome("complete", launch.read_metrics(d)) for d in dirs]
            self.ledger.record(t.number, key, judge(outcomes, seeds, self.spec.objective.metric))
            return None
        if rec.host == self.me.host and any(launch.is_active(d) for d in dirs):
            self.ledger.write(t.number, TrialRecord(driver=self.me.id, heartbeat=time.time()))
            log.info("trial %d (%s): driver gone, process alive: adopting it", t.number, key)
            return Adopt(t.number, point, seeds, key)
        self.ledger.tell(t.number, TrialState.FAIL, outcome="failed",
                         message=f"its driver {rec.driver} died and the process is gone")
        log.warning("trial %d (%s): driver and process gone: failed, will be retried",
                    t.number, key)
        return None
