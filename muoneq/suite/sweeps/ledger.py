"""What a study holds about each run, read and written through Optuna's public API only.

A *run key* names one run: ``<point key> | seed=<seed>`` in a grid or a coordinate descent (one
trial per point and seed), the point key in a TPE search (one trial runs every seed). The ledger
groups the study's trials by run key (:class:`RunState`): finished, running under a live driver,
orphaned (their driver died), queued, or failed; it derives the study's plan from the finished
runs (:meth:`Ledger.replan`), counts what is done (:class:`Summary`) and records what happened
to a trial (user attributes, then ``study.tell``), on the storage object the driver opened
(``optuna.storages.BaseStorage``).

A driver is alive while it holds its lock file ``<study>/drivers/<id>.lock`` (same machine) or
its trials' heartbeats keep changing (other machines: a heartbeat that this driver has seen
unchanged for ``retry.stale_after_s`` of its own clock is stale; two machines' clocks are never
compared, so a clock that runs ahead or behind declares no live trial dead).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from muoneq.suite.sweeps import distributions, hparams, launch
from muoneq.suite.sweeps.plan import Check, Plan, describe_plan, make_plan
from muoneq.suite.sweeps.report_spec import metrics_named
from muoneq.suite.sweeps.spec import Point, SweepSpec, format_value
from muoneq.suite.sweeps.study import existing_study
from muoneq.suite.sweeps.trial_record import (
    FAILURES,
    STUDY_BEST,
    STUDY_DISTRIBUTIONS,
    STUDY_PLAN,
    TrialRecord,
)
from muoneq.suite.sweeps.verdict import Verdict

log = logging.getLogger("muoneq.suite.sweeps")

DONE_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


@dataclass(frozen=True)
class DriverId:
    """One driver process: its id (``host:pid:random``), its host, and the folder of the lock
    files drivers hold while they live."""

    id: str
    host: str
    locks: Path

    @classmethod
    def new(cls, study_dir: Path) -> DriverId:
        host = socket.gethostname()
        return cls(f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}", host,
                   Path(study_dir) / "drivers")

    def lock_path(self, driver_id: str | None = None) -> Path:
        """The lock file of driver ``driver_id`` (default: this one)."""
        return self.locks / ((driver_id or self.id).replace(":", "_") + ".lock")


@dataclass
class RunState:
    """Everything the study holds about one run (one key)."""

    done: list[FrozenTrial] = field(default_factory=list)
    live: list[FrozenTrial] = field(default_factory=list)
    orphans: list[FrozenTrial] = field(default_factory=list)
    waiting: list[FrozenTrial] = field(default_factory=list)
    failures: int = 0
    config_error: bool = False  #: an attempt of this driver exited with a config error
    tried: list[FrozenTrial] = field(default_factory=list)  #: failed or interrupted attempts


@dataclass
class Survey:
    """The study's trials by run key, and how many queued trials have no key yet (enqueued
    with parameters only: their run is known once asked)."""

    runs: dict[str, RunState]
    unkeyed_waiting: int = 0


@dataclass
class Summary:
    total: int
    done: int
    exhausted: list[str]
    pending: int
    #: the signal that stopped the driver (SIGINT, SIGTERM), or None
    stopped_by: int | None = None

    @property
    def interrupted(self) -> bool:
        return self.stopped_by is not None

    @property
    def exit_code(self) -> int:
        """The shell's status for the signal that stopped it (130: SIGINT, 143: SIGTERM); 1
        while runs failed for good or remain; else 0."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return 1 if self.exhausted or self.pending else 0


SEED_SEP = " | seed="


def grid_key(cell: str, seed: int) -> str:
    """The run key of point ``cell`` (a point key) with ``seed`` in a planned study."""
    return f"{cell}{SEED_SEP}{seed}"


def split_key(key: str) -> tuple[str, int]:
    """``grid_key``'s inverse: (point key, seed)."""
    cell, _, seed = key.rpartition(SEED_SEP)
    return cell, int(seed)


class Ledger:
    """The study's record of every run, for one driver (see the module docstring)."""

    def __init__(self, study: optuna.Study, storage: BaseStorage, spec: SweepSpec, me: DriverId,
                 study_dir: Path, check: Check | None = None):
        self.study, self.storage, self.spec, self.me = study, storage, spec, me
        self.study_dir = Path(study_dir)
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.check = check  #: why a point bracketing would add cannot run (a config error)
        #: the plan's points by key, and their run keys (empty for a TPE search)
        self.plan: Plan | None = None
        self.points: dict[str, Point] = {}
        self.expected: set[str] = set()
        self._trial_ids: dict[int, int] = {}
        self._said: dict | None = None
        self._logged: set[str] = set()
        #: this driver's clock, and each foreign trial's last heartbeat with when it was first
        #: seen by it (:meth:`owner_alive`)
        self.clock = time.monotonic
        self._beats: dict[int, tuple[float, float]] = {}
        #: each axis' Optuna distribution, as the study recorded it (planned studies)
        self.distributions = distributions.from_json(study.user_attrs.get(STUDY_DISTRIBUTIONS))
        if spec.planned:
            self.replan()

    # ---------------------------------------------------------------------------------- keys
    def point_of(self, params: dict) -> Point | None:
        """A TPE trial's point, from its parameters."""
        axes = self.spec.axes()
        if not all(a in params for a in axes):
            return None
        return Point(tuple((a, params[a]) for a in axes))

    def point_of_trial(self, t: FrozenTrial) -> Point | None:
        """The point a trial runs: from the plan (planned studies), else its parameters."""
        if not self.spec.planned:
            return self.point_of(t.params)
        key = TrialRecord.of(t).run_key
        return self.points.get(split_key(key)[0]) if key is not None else None

    def key_of(self, t: FrozenTrial) -> str | None:
        key = TrialRecord.of(t).run_key
        if key is not None:
            return key
        if self.spec.planned:
            return None
        point = self.point_of(t.params)
        return point.key if point is not None else None

    # ---------------------------------------------------------------------------------- plan
    def results(self, runs: dict[str, RunState]) -> dict[str, list[float | None]]:
        """The objective per seed of every point whose runs have all finished or failed for
        good (diverged or pruned: None), by point key (:data:`muoneq.suite.sweeps.plan.Results`)."""
        by_point: dict[str, dict[int, RunState]] = defaultdict(dict)
        for key, state in runs.items():
            cell, seed = split_key(key)
            by_point[cell][seed] = state
        out = {}
        for cell, states in by_point.items():
            values, final = [], True
            for seed in self.spec.seeds:
                state = states.get(seed)
                if state is not None and state.done:
                    t = state.done[0]
                    values.append(t.value if t.state == TrialState.COMPLETE else None)
                elif state is None or not self.exhausted(state):
                    final = False
                    break
            if final:
                out[cell] = values
        return out

    def replan(self, survey: Survey | None = None) -> Plan:
        """Derive the plan from the finished runs; publish what it says when that changed."""
        runs = (survey or self.survey()).runs
        plan = make_plan(self.spec, self.results(runs), self.check)
        self.plan = plan
        self.points = {p.key: p for p in plan.points}
        self.expected = {grid_key(k, s) for k in self.points for s in self.spec.seeds}
        said = plan.to_dict()
        if said != self._said and (plan.families or plan.path):
            self._said = said
            if said != self.study.user_attrs.get(STUDY_PLAN):
                self.study.set_user_attr(STUDY_PLAN, said)
            for line in describe_plan(said):
                if line not in self._logged:
                    self._logged.add(line)
                    log.info("plan: %s", line)
        return plan

    # --------------------------------------------------------------------------------- reads
    def trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)

    def owner_alive(self, t: FrozenTrial) -> bool:
        rec = TrialRecord.of(t)
        owner = rec.driver
        if owner == self.me.id:
            return True
        if owner is not None and rec.host == self.me.host:
            # A driver on this machine holds its lock file for its whole life.
            return launch.lock_is_held(self.me.lock_path(owner))
        last = rec.heartbeat
        if last is None and t.datetime_start is not None:
            last = t.datetime_start.timestamp()
        if last is None:
            return False
        # Another machine: its heartbeat is a time on its own clock; alive while it changes
        # within stale_after_s of this driver's clock (module docstring).
        now = self.clock()
        seen = self._beats.get(t.number)
        if seen is None or seen[0] != last:
            self._beats[t.number] = (last, now)
            return True
        return now - seen[1] < self.spec.retry.stale_after_s

    def survey(self) -> Survey:
        """Group every trial of the study by run key (skipped duplicates left out). A running
        trial without a key whose driver died (it died between ask and choosing a point) is
        told FAIL on the way."""
        survey = Survey(defaultdict(RunState))
        for t in self.trials():
            rec = TrialRecord.of(t)
            outcome = rec.outcome
            if rec.skipped:
                continue
            key = self.key_of(t)
            if key is None:
                if t.state == TrialState.RUNNING and not self.owner_alive(t):
                    self.tell(t.number, TrialState.FAIL, outcome="abandoned",
                              message="asked by a driver that died before choosing a point")
                survey.unkeyed_waiting += t.state == TrialState.WAITING
                continue
            state = survey.runs[key]
            if t.state in DONE_STATES or (t.state == TrialState.FAIL and rec.diverged):
                state.done.append(t)
            elif t.state == TrialState.RUNNING:
                (state.live if self.owner_alive(t) else state.orphans).append(t)
            elif t.state == TrialState.WAITING:
                state.waiting.append(t)
            elif t.state == TrialState.FAIL:
                state.failures += outcome in FAILURES
                state.config_error |= (outcome == "config_error"
                                       and rec.driver == self.me.id)
                state.tried.append(t)
        return survey

    def exhausted(self, state: RunState) -> bool:
        return not state.done and (state.config_error
                                   or state.failures > self.spec.retry.max_retries)

    def is_open(self, state: RunState) -> bool:
        """True when the run needs a new attempt (nothing finished, running or queued)."""
        return not (state.done or state.live or state.orphans or state.waiting
                    or self.exhausted(state))

    def configs_started(self) -> list[int]:
        """Trial numbers of an open search's configurations (retries and skipped trials
        excluded)."""
        records = ((t.number, TrialRecord.of(t)) for t in self.trials())
        return sorted(n for n, rec in records if rec.retry_of is None and not rec.skipped)

    def duplicate_of(self, number: int, key: str) -> int | None:
        """The trial that already holds run ``key`` (finished, or running under a lower
        number), or the last configuration within an open search's budget when trial
        ``number`` is over it; None when trial ``number`` may run."""
        over_budget = None
        if not self.spec.planned:
            started, budget = self.configs_started(), self.spec.search.n_trials
            if number in started and started.index(number) >= budget:
                over_budget = started[budget - 1]
        waited_since = time.monotonic()
        while True:
            undecided = False
            for t in self.trials():
                rec = TrialRecord.of(t)
                if t.number == number or rec.skipped or self.key_of(t) != key:
                    continue
                finished = t.state in DONE_STATES or rec.diverged
                if finished or (t.state == TrialState.RUNNING and t.number < number):
                    return t.number
                if t.state == TrialState.RUNNING:
                    # A later claim of the same run. Its driver took the run (wrote its
                    # ``driver``) only if it did not see this claim, written before it looked:
                    # then this trial is the duplicate. Until it has decided, wait (claims are
                    # written and read by separate transactions, so either driver may be the one
                    # that saw the other).
                    if rec.driver is not None:
                        return t.number
                    undecided = True
            if not undecided or time.monotonic() - waited_since > self.spec.retry.stale_after_s:
                return over_budget
            time.sleep(0.05)

    def summary(self, runs: dict[str, RunState] | None = None) -> Summary:
        runs = self.survey().runs if runs is None else runs
        keys = self.expected if self.spec.planned else set(runs)
        total = len(keys) if self.spec.planned else self.spec.search.n_trials
        done = sum(1 for k in keys if runs.get(k) and runs[k].done)
        exhausted = sorted(k for k in keys if k in runs and self.exhausted(runs[k]))
        return Summary(total, done, exhausted, max(0, total - done - len(exhausted)))

    # -------------------------------------------------------------------------------- writes
    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number`` of this study."""
        if number not in self._trial_ids:
            self._trial_ids[number] = self.storage.get_trial_id_from_study_id_trial_number(
                self.study_id, number)
        return self._trial_ids[number]

    def write(self, number: int, record: TrialRecord) -> None:
        """Write the fields set in ``record`` to trial ``number`` (any driver's, running)."""
        trial_id = self.trial_id(number)
        for name, value in record.attrs().items():
            self.storage.set_trial_user_attr(trial_id, name, value)

    def set_params(self, number: int, point: Point) -> None:
        """Give trial ``number`` its point as Optuna params, in the study's distributions
        (:mod:`muoneq.suite.sweeps.distributions`); a value a recorded distribution lacks is left
        out, and said once."""
        trial_id = self.trial_id(number)
        for axis, value in point.items:
            dist = self.distributions.get(axis)
            if dist is not None and distributions.contains(dist, value):
                self.storage.set_trial_param(trial_id, axis, dist.to_internal_repr(value), dist)
                continue
            line = (f"{axis}={format_value(value)} is not in the study's Optuna distribution "
                    f"{dist!r}: its trials lack that param in Optuna's views (a new study "
                    "name would include it)")
            if line not in self._logged:
                self._logged.add(line)
                log.warning("%s", line)

    def tell(self, number: int, state: TrialState, *, value: float | None = None,
             outcome: str, message: str = "", record: TrialRecord | None = None) -> None:
        """Write the record, then tell. A trial someone else finished meanwhile is left
        alone."""
        if self.storage.get_trial(self.trial_id(number)).state.is_finished():
            log.info("trial %d was finished by another driver meanwhile", number)
            return
        record = record or TrialRecord()
        record.outcome, record.message = outcome, message[-4000:]
        self.write(number, record)
        trial_id = self.trial_id(number)
        for key, metric in self.columns(record.metrics).items():
            self.storage.set_trial_user_attr(trial_id, key, metric)
        self.study.tell(number, value if state == TrialState.COMPLETE else None, state=state,
                        skip_if_finished=True)

    def columns(self, metrics: dict | None) -> dict:
        """The objective and the metrics the report names, from a trial's ``metrics``: user
        attributes of their own names, columns of ``study.trials_dataframe()``."""
        named = [self.spec.objective.metric, *metrics_named(self.spec.report)]
        reserved = {f.name for f in fields(TrialRecord)}
        return {k: metrics[k] for k in named if metrics and k in metrics and k not in reserved}

    def publish_best(self) -> None:
        """Record the point with the best mean objective over its seeds (every seed finished,
        none diverged) as the study's user attribute :data:`STUDY_BEST`, when it changed:
        Optuna's ``study.best_trial`` is the best single trial, the luckiest seed of a grid."""
        minimize = self.spec.objective.direction == "minimize"
        candidates = []  # (mean, point, seeds, trial numbers)
        if self.spec.planned:
            runs = self.survey().runs
            for cell, values in self.results(runs).items():
                if values and all(v is not None for v in values):
                    done = [runs[grid_key(cell, s)].done[0] for s in self.spec.seeds]
                    candidates.append((sum(values) / len(values), TrialRecord.of(done[0]).point,
                                       list(self.spec.seeds), [t.number for t in done]))
        else:  # a trial runs every seed and is told their mean
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                rec = TrialRecord.of(t)
                candidates.append((t.value, rec.point, rec.seeds, [t.number]))
        if not candidates:
            return
        mean, point, seeds, numbers = (min if minimize else max)(candidates, key=lambda c: c[0])
        best = {"point": point, "key": Point(tuple(point.items())).key,
                self.spec.objective.metric: mean, "seeds": seeds, "trials": numbers}
        if best != self.study.user_attrs.get(STUDY_BEST):
            self.study.set_user_attr(STUDY_BEST, best)

    def record(self, number: int, key: str, verdict: Verdict) -> None:
        """Tell how trial ``number`` (run ``key``) ended, log it, and add its finished runs to
        TensorBoard's HParams view (:mod:`muoneq.suite.sweeps.hparams`)."""
        self.tell(number, verdict.state, value=verdict.value, outcome=verdict.outcome,
                  message=verdict.message, record=verdict.record)
        if verdict.outcome == "complete":
            self.publish_best()
        if verdict.outcome in ("complete", "diverged"):
            rec = TrialRecord.of(self.storage.get_trial(self.trial_id(number)))
            point = Point(tuple((rec.point or {}).items()))
            try:
                for _, metrics, rel in rec.runs():
                    hparams.write_session(self.spec, point, self.study_dir / rel, metrics,
                                          diverged=verdict.outcome == "diverged")
            except OSError as err:  # the view is a convenience: never lose the trial over it
                log.warning("trial %d: TensorBoard HParams not written: %s", number, err)
        metric = self.spec.objective.metric
        if verdict.outcome == "complete":
            log.info("trial %d (%s): %s = %.4g", number, key, metric, verdict.value)
        elif verdict.outcome == "diverged":
            log.info("trial %d (%s): diverged (%s)", number, key, verdict.message)
        elif verdict.missing_metric:
            log.error("trial %d (%s): %s (not retried: fix objective.metric)", number, key,
                      verdict.message)
        else:
            note = " (not retried: fix it, then re-run the sweep)" if (
                verdict.outcome == "config_error") else ""
            quiet = verdict.outcome in ("pruned", "interrupted")
            message = verdict.message
            log.log(logging.INFO if quiet else logging.WARNING, "trial %d (%s): %s%s%s",
                    number, key, verdict.outcome, note,
                    "" if not message else f"\n{message}" if "\n" in message else f": {message}")


def published_plan(spec: SweepSpec, url: str | None, study_dir: Path) -> dict | None:
    """What the study's drivers last published about its plan (:data:`STUDY_PLAN`), or None when
    the study does not exist yet; creates nothing."""
    found = existing_study(spec, url, study_dir)
    return found[0].user_attrs.get(STUDY_PLAN) if found is not None else None
