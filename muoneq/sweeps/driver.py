"""The sweep driver: Optuna ask/tell over trial *processes*, resumable and loss-free.

Each Optuna trial is one run (a grid point with one seed) or, for an open TPE search, one
configuration evaluated on every seed (told their mean). The driver ``ask``s, launches the trial
command (see :mod:`muoneq.sweeps.launch`), heartbeats and reports intermediate values while it
runs, reads ``metrics.json`` and ``tell``s. Any number of drivers (``--workers`` threads in one
process, several processes, several machines on one RDB storage) share a study:

* **duplicates**: ``GridSampler`` can hand one point to two workers; after ``ask`` a worker
  skips its trial when the same run is already finished or running under a lower trial number
  (so exactly one of two racing workers goes on). Skipped trials are told FAIL with
  ``outcome=skipped`` and are never counted;
* **stopping on counts**: a worker stops when every run of the grid (or ``search.n_trials``
  configurations) is finished or has used up its retries, and waits while other workers still
  hold the last runs (it takes them over if their driver dies);
* **crashes**: a trial whose driver died is recognised (same machine: the driver's lock file is
  free; other machines: no heartbeat for ``retry.stale_after_s``). If its process finished,
  its ``metrics.json`` is told; if the process still runs, the trial is adopted and waited for;
  otherwise it is told FAIL and re-queued, up to ``retry.max_retries`` times. A run folder that
  already holds ``metrics.json`` is told, never run again;
* **config errors**: before the study is created or continued, every point's training config is
  composed and existing run folders are compared with it (:mod:`muoneq.sweeps.validate`). A run
  whose process exits with status 2 (the ``muoneq`` command's status for a mistake the user must
  fix: a config, data or resume error) is failed at once, without retries; a later driver (the
  same command run again, after the fix) tries it once more.

Optuna's ``RetryFailedTrialCallback`` and heartbeats only work inside ``study.optimize``; this
bookkeeping is their ask/tell equivalent, keyed by the run rather than the trial.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, Trial, TrialState

from muoneq.sweeps import launch
from muoneq.sweeps.events import ScalarReader
from muoneq.sweeps.spec import Point, SweepError, SweepSpec, format_value, spec_to_dict
from muoneq.sweeps.storage import open_storage, storage_label
from muoneq.sweeps.validate import check_trials

log = logging.getLogger("muoneq.sweeps")

#: user attrs of a trial that the driver writes (the report reads them too)
ATTR_KEY, ATTR_POINT, ATTR_SEEDS, ATTR_DIRS = "run_key", "point", "seeds", "run_dirs"
ATTR_DRIVER, ATTR_HOST, ATTR_BEAT, ATTR_OUTCOME = "driver", "host", "heartbeat", "outcome"
#: outcomes that use up a retry; ``diverged`` (non-finite objective) is a result, not a failure
FAILURES = ("failed", "timeout")
#: a trial process that exits with this status has a config, data or resume error (``muoneq``
#: prints it as one line): retrying cannot help, the user must fix it
CONFIG_ERROR_EXIT = 2
DONE_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


class AskTellGridSampler(optuna.samplers.GridSampler):
    """``GridSampler`` for ask/tell: its ``after_trial`` calls ``study.stop()``, which raises
    outside ``study.optimize`` (optuna/optuna#5141) and reads a ``grid_id`` that enqueued
    retries lack. The driver stops on its own counts instead."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


class _GridRepeatFilter(logging.Filter):
    """GridSampler warns when it re-proposes a point; the driver detects and skips those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "re-evaluating a configuration" not in record.getMessage()


@dataclass
class DriverOptions:
    storage: str | None = None  #: None: the journal file under the study folder
    workers: int = 1
    devices: list[str] | None = None  #: accelerator ids to split between workers
    runs_dir: Path = Path("runs")
    poll_s: float = 5.0  #: how often an idle worker looks for work again
    tick_s: float = 1.0  #: how often a running trial is checked


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
class Summary:
    total: int
    done: int
    exhausted: list[str]
    pending: int
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if self.exhausted or self.pending else 0


def _attr(t: FrozenTrial, name: str, default=None):
    return t.user_attrs.get(name, default)


class Driver:
    """Run a sweep to completion (or until interrupted); see the module docstring."""

    def __init__(self, spec: SweepSpec, options: DriverOptions | None = None):
        self.spec = spec
        self.opts = options or DriverOptions()
        self.study_dir = Path(self.opts.runs_dir) / spec.study
        self.host = socket.gethostname()
        self.driver_id = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._slots = self._device_slots()
        if spec.is_grid:
            self.points = {p.key: p for p in spec.points()}
            self.expected = {self._grid_key(k, s) for k in self.points for s in spec.seeds}
        self.validated = check_trials(spec, self.study_dir)  # before the study is created
        self.study = self._open_study()

    # ------------------------------------------------------------------------------- setup
    def _device_slots(self) -> list[list[str]]:
        n, per = self.opts.workers, self.spec.launch.devices_per_trial
        if n < 1:
            raise SweepError(f"--workers must be ≥ 1 (got {n})")
        if per == 0:
            return [[] for _ in range(n)]
        devices = self.opts.devices
        if devices is None:
            visible = os.environ.get(self.spec.launch.device_env)
            if visible:
                devices = [d for d in visible.split(",") if d]
            else:
                import torch

                devices = [str(i) for i in range(torch.cuda.device_count())]
        if len(devices) < n * per:
            raise SweepError(
                f"--workers {n} × launch.devices_per_trial {per} needs {n * per} devices, "
                f"found {len(devices)} ({','.join(devices) or 'none'}); pass --devices, fewer "
                "--workers, or --set launch.devices_per_trial=0 (each trial sees every device)"
            )
        return [devices[i * per:(i + 1) * per] for i in range(n)]

    def _sampler(self) -> optuna.samplers.BaseSampler:
        if self.spec.is_grid:
            return AskTellGridSampler({"cell": list(self.points), "seed": list(self.spec.seeds)})
        s = self.spec.search
        return optuna.samplers.TPESampler(seed=s.sampler_seed, n_startup_trials=s.n_startup_trials)

    def _pruner(self) -> optuna.pruners.BasePruner:
        p = self.spec.prune
        if not p.enabled:
            return optuna.pruners.NopPruner()
        if p.pruner == "median":
            return optuna.pruners.MedianPruner(p.n_startup_trials, p.n_warmup_steps)
        if p.pruner == "percentile":
            return optuna.pruners.PercentilePruner(p.percentile, p.n_startup_trials,
                                                   p.n_warmup_steps)
        if p.pruner == "successive_halving":
            return optuna.pruners.SuccessiveHalvingPruner()
        return optuna.pruners.HyperbandPruner()

    def fingerprint(self) -> dict:
        """What may not change while a study goes on (the grid and seeds may grow)."""
        s = self.spec
        return {"experiment": s.experiment, "overrides": list(s.overrides),
                "objective": [s.objective.metric, s.objective.direction],
                "command": s.launch.command, "kind": "grid" if s.is_grid else "search"}

    def _open_study(self) -> optuna.Study:
        self.study_dir.mkdir(parents=True, exist_ok=True)
        storage = open_storage(self.opts.storage, self.study_dir)
        study = optuna.create_study(
            study_name=self.spec.study, storage=storage, sampler=self._sampler(),
            pruner=self._pruner(), direction=self.spec.objective.direction, load_if_exists=True,
        )
        recorded = study.user_attrs.get("fingerprint")
        mine = json.loads(json.dumps(self.fingerprint()))
        if recorded is None:
            study.set_user_attr("fingerprint", mine)
        elif recorded != mine:
            changed = sorted(k for k in mine if recorded.get(k) != mine[k])
            where = storage_label(self.opts.storage, self.study_dir)
            delete = (f"delete it (rm -r {self.study_dir})" if self.opts.storage is None else
                      f"delete it (optuna delete-study --study-name {self.spec.study} --storage "
                      f"{where}, and rm -r {self.study_dir})")
            raise SweepError(
                f"study {self.spec.study!r} in {where} was created with other "
                f"{', '.join(changed)} (below), and a study keeps the settings it started with; "
                "restore them (the sweep file, --set and --override), give this sweep a new "
                f"study name (--set study=NAME), or {delete} to start over",
                details=[f"{k}: {recorded.get(k)!r} → {mine[k]!r}" for k in changed],
            )
        study.set_user_attr("spec", spec_to_dict(self.spec))
        (self.study_dir / "sweep.yaml").write_text(OmegaConf.to_yaml(spec_to_dict(self.spec)))
        return study

    # ------------------------------------------------------------------------------- keys
    @staticmethod
    def _grid_key(cell: str, seed: int) -> str:
        return f"{cell} | seed={seed}"

    def _point_of(self, params: dict) -> Point | None:
        if self.spec.is_grid:
            return self.points.get(params.get("cell"))
        axes = self.spec.axes()
        if not all(a in params for a in axes):
            return None
        return Point(tuple((a, params[a]) for a in axes))

    def _key_of(self, t: FrozenTrial) -> str | None:
        if ATTR_KEY in t.user_attrs:
            return t.user_attrs[ATTR_KEY]
        params = t.system_attrs.get("fixed_params", t.params)
        if self.spec.is_grid:
            if "cell" in params and "seed" in params:
                return self._grid_key(params["cell"], params["seed"])
            return None
        point = self._point_of(params)
        return point.key if point is not None else None

    # ------------------------------------------------------------------------------ survey
    def _owner_alive(self, t: FrozenTrial) -> bool:
        owner = _attr(t, ATTR_DRIVER)
        if owner == self.driver_id:
            return True
        if owner is not None and _attr(t, ATTR_HOST) == self.host:
            # A driver on this machine holds ``drivers/<id>.lock`` for its whole life.
            return launch.lock_is_held(self._driver_lock_path(owner))
        last = _attr(t, ATTR_BEAT)
        if last is None and t.datetime_start is not None:
            last = t.datetime_start.timestamp()
        return last is not None and time.time() - last < self.spec.retry.stale_after_s

    def survey(self) -> dict[str, RunState]:
        """Group every trial of the study by run key (skipped duplicates left out)."""
        runs: dict[str, RunState] = defaultdict(RunState)
        for t in self.study.get_trials(deepcopy=False):
            outcome = _attr(t, ATTR_OUTCOME)
            if outcome == "skipped":
                continue
            key = self._key_of(t)
            if key is None:
                if t.state == TrialState.RUNNING and not self._owner_alive(t):
                    self._tell(t.number, TrialState.FAIL, outcome="abandoned",
                               message="asked by a driver that died before choosing a point")
                continue
            state = runs[key]
            if t.state in DONE_STATES or (t.state == TrialState.FAIL and outcome == "diverged"):
                state.done.append(t)
            elif t.state == TrialState.RUNNING:
                (state.live if self._owner_alive(t) else state.orphans).append(t)
            elif t.state == TrialState.WAITING:
                state.waiting.append(t)
            elif t.state == TrialState.FAIL:
                state.failures += outcome in FAILURES
                state.config_error |= (outcome == "config_error"
                                       and _attr(t, ATTR_DRIVER) == self.driver_id)
                state.tried.append(t)
        return runs

    def _exhausted(self, state: RunState) -> bool:
        return not state.done and (state.config_error
                                   or state.failures > self.spec.retry.max_retries)

    def _open(self, state: RunState) -> bool:
        """True when the run needs a new attempt (nothing finished, running or queued)."""
        return not (state.done or state.live or state.orphans or state.waiting
                    or self._exhausted(state))

    def _configs_started(self) -> list[int]:
        """Trial numbers of TPE configurations (retries and skipped trials excluded)."""
        return sorted(t.number for t in self.study.get_trials(deepcopy=False)
                      if "retry_of" not in t.user_attrs and _attr(t, ATTR_OUTCOME) != "skipped")

    def summary(self, runs: dict[str, RunState] | None = None) -> Summary:
        runs = self.survey() if runs is None else runs
        keys = self.expected if self.spec.is_grid else set(runs)
        total = len(keys) if self.spec.is_grid else self.spec.search.n_trials
        done = sum(1 for k in keys if runs.get(k) and runs[k].done)
        exhausted = sorted(k for k in keys if k in runs and self._exhausted(runs[k]))
        return Summary(total, done, exhausted, max(0, total - done - len(exhausted)))

    # --------------------------------------------------------------------------- the loop
    def _next_job(self, slot: int):
        """Under the in-process lock: resolve orphans, queue retries, ask. Returns a job, the
        string ``"wait"`` (others hold the last runs) or None (the study is finished)."""
        runs = self.survey()
        orphans = [(key, t) for key, state in runs.items() for t in state.orphans]
        for key, t in orphans:
            job = self._resolve_orphan(t, key)
            if job is not None:
                return job
        if orphans:
            runs = self.survey()
        queued = False
        keys = self.expected if self.spec.is_grid else set(runs)  # not points of an old grid
        for state in (runs[k] for k in keys if k in runs):
            if state.tried and self._open(state):
                last = state.tried[-1]
                params = last.system_attrs.get("fixed_params", last.params)
                self.study.enqueue_trial(params, user_attrs={"retry_of": last.number})
                queued = True
        waiting = queued or any(s.waiting for s in runs.values())
        if self.spec.is_grid:
            fresh = any(k not in runs or self._open(runs[k]) for k in self.expected)
        else:
            fresh = len(self._configs_started()) < self.spec.search.n_trials
        if not (waiting or fresh):
            busy = any(s.live or s.orphans for s in runs.values())
            return "wait" if busy else None
        return self._ask(slot)

    def _ask(self, slot: int):
        trial = self.study.ask()
        if self.spec.is_grid:
            cell = trial.suggest_categorical("cell", list(self.points))
            seed = trial.suggest_categorical("seed", list(self.spec.seeds))
            point, seeds, key = self.points[cell], [seed], self._grid_key(cell, seed)
        else:
            params = {}
            for name, p in self.spec.search.params.items():
                if p.type == "float":
                    params[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
                elif p.type == "int":
                    params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
                else:
                    params[name] = trial.suggest_categorical(name, list(p.choices))
            point, seeds = self._point_of(params), list(self.spec.seeds)
            key = point.key
        duplicate = self._duplicate_of(trial.number, key)
        if duplicate is not None:
            self._tell(trial.number, TrialState.FAIL, outcome="skipped",
                       message=f"duplicate of trial {duplicate}")
            log.info("trial %d: %s is already taken by trial %d; skipped",
                     trial.number, key, duplicate)
            return "again"
        runs = self.survey().get(key, RunState())
        dirs = [str(self._run_dir(point, s).relative_to(self.study_dir)) for s in seeds]
        attrs = {ATTR_KEY: key, ATTR_POINT: point.as_dict(), ATTR_SEEDS: seeds, ATTR_DIRS: dirs,
                 ATTR_DRIVER: self.driver_id, ATTR_HOST: self.host, ATTR_BEAT: time.time(),
                 "attempt": runs.failures + 1}
        for name, value in attrs.items():
            trial.set_user_attr(name, value)
        return ("run", trial, point, seeds, key)

    def _duplicate_of(self, number: int, key: str) -> int | None:
        over_budget = None
        if not self.spec.is_grid:
            started = self._configs_started()
            if number in started and started.index(number) >= self.spec.search.n_trials:
                over_budget = started[self.spec.search.n_trials - 1]
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or _attr(t, ATTR_OUTCOME) == "skipped":
                continue
            if self._key_of(t) != key:
                continue
            finished = t.state in DONE_STATES or _attr(t, ATTR_OUTCOME) == "diverged"
            if finished or (t.state == TrialState.RUNNING and t.number < number):
                return t.number
        return over_budget

    def _resolve_orphan(self, t: FrozenTrial, key: str):
        """A trial whose driver died: tell its result, adopt its live process, or fail it."""
        point = self._point_of(t.system_attrs.get("fixed_params", t.params))
        seeds = _attr(t, ATTR_SEEDS) or []
        dirs = [self.study_dir / d for d in _attr(t, ATTR_DIRS, [])]
        if point is None or not dirs:
            self._tell(t.number, TrialState.FAIL, outcome="failed",
                       message="its driver died before launching it")
            return None
        if all(launch.read_metrics(d) is not None for d in dirs):
            log.info("trial %d (%s): driver gone, run finished: telling its result",
                     t.number, key)
            self._finish(t.number, point, [launch.Outcome("complete", launch.read_metrics(d))
                                           for d in dirs], seeds, key)
            return None
        same_host = _attr(t, ATTR_HOST) == self.host
        if same_host and any(launch.is_active(d) for d in dirs):
            self.study._storage.set_trial_user_attr(t._trial_id, ATTR_DRIVER, self.driver_id)
            self.study._storage.set_trial_user_attr(t._trial_id, ATTR_BEAT, time.time())
            log.info("trial %d (%s): driver gone, process alive: adopting it", t.number, key)
            return ("adopt", t, point, seeds, key)
        self._tell(t.number, TrialState.FAIL, outcome="failed",
                   message=f"its driver {_attr(t, ATTR_DRIVER)} died and the process is gone")
        log.warning("trial %d (%s): driver and process gone: failed, will be retried",
                    t.number, key)
        return None

    def _run_dir(self, point: Point, seed: int) -> Path:
        return point.run_dir(self.study_dir, seed)

    def _worker(self, slot: int) -> None:
        while not self.stop.is_set():
            with self._lock:
                job = self._next_job(slot)
            if job is None:
                return
            if job == "again":
                continue
            if job == "wait":
                self.stop.wait(self.opts.poll_s)
                continue
            try:
                self._execute(job, slot)
            except launch.ResultMismatch as err:
                self._tell(job[1].number, TrialState.FAIL, outcome="failed", message=str(err))
                log.error("%s", err)

    # -------------------------------------------------------------------------- execution
    def _execute(self, job, slot: int) -> None:
        kind, trial, point, seeds, key = job
        trial_id = trial._trial_id
        if kind == "adopt":
            tick = _Ticker(self, trial_id, None, None)
            outcomes = []
            for seed in seeds:
                outcome = launch.wait_for_release(self._run_dir(point, seed), on_tick=tick,
                                                  tick_s=self.opts.tick_s)
                if outcome.status == "interrupted":
                    return  # the process is not ours: leave the trial for the next driver
                outcomes.append(outcome)
                if outcome.status != "complete":
                    break
            self._finish(trial.number, point, outcomes, seeds, key)
            return
        outcomes: list[launch.Outcome] = []
        for i, seed in enumerate(seeds):
            run_dir = self._run_dir(point, seed)
            argv, env, fingerprint = trial_command(
                self.spec, point, seed, run_dir, trial=trial.number, devices=self._slots[slot],
                worker=slot)
            metrics = launch.read_metrics(run_dir)
            if metrics is not None:
                launch.check_fingerprint(run_dir, fingerprint)
                log.info("trial %d (%s): %s already holds metrics.json: told, not re-run",
                         trial.number, key, run_dir)
                outcomes.append(launch.Outcome("complete", metrics))
                continue
            prune = self.spec.prune.enabled and i == 0
            tick = _Ticker(self, trial_id, trial, ScalarReader(run_dir) if prune else None)
            log.info("trial %d (%s): started on worker %d", trial.number, key, slot)
            log.debug("trial %d: %s", trial.number, " ".join(argv))  # also in its trial.log
            outcome = launch.run_process(argv, run_dir, env=env, fingerprint=fingerprint,
                                         on_tick=tick, tick_s=self.opts.tick_s,
                                         timeout_s=self.spec.launch.timeout_s)
            if outcome.status == "busy":  # a live process of a lost trial owns the folder
                outcome = launch.wait_for_release(run_dir, on_tick=tick, tick_s=self.opts.tick_s)
            if outcome.status == "complete":
                tick.report()  # the whole curve, for the pruner's later comparisons
            outcomes.append(outcome)
            if outcome.status != "complete":
                break
        self._finish(trial.number, point, outcomes, seeds, key)

    def _finish(self, number: int, point: Point, outcomes: list[launch.Outcome],
                seeds: list[int], key: str) -> None:
        """Tell Optuna how the trial ended (values, PRUNED or FAIL with the reason)."""
        last = outcomes[-1] if outcomes else launch.Outcome("failed", message="nothing ran")
        per_seed = [o.metrics for o in outcomes if o.metrics is not None]
        attrs: dict = {}
        if per_seed:
            attrs["metrics"] = per_seed[0] if len(seeds) == 1 else _mean_metrics(per_seed)
            if len(seeds) > 1:
                attrs["metrics_per_seed"] = per_seed
        if last.status != "complete" or len(outcomes) < len(seeds):
            status = last.status if last.status in ("pruned", "interrupted", "timeout") else (
                "config_error" if last.returncode == CONFIG_ERROR_EXIT else "failed")
            state = TrialState.PRUNED if status == "pruned" else TrialState.FAIL
            self._tell(number, state, outcome=status, message=last.message, attrs=attrs)
            note = " (not retried: fix it, then re-run the sweep)" if (
                status == "config_error") else ""
            log.log(logging.INFO if status in ("pruned", "interrupted") else logging.WARNING,
                    "trial %d (%s): %s%s %s", number, key, status, note,
                    ("\n" + last.message) if last.message else "")
            return
        metric = self.spec.objective.metric
        missing = [i for i, m in enumerate(per_seed) if metric not in m]
        if missing:
            self._tell(number, TrialState.FAIL, outcome="failed", attrs=attrs,
                       message=f"metrics.json has no {metric!r}; keys: {sorted(per_seed[0])}")
            log.error("trial %d (%s): metrics.json has no %r", number, key, metric)
            return
        values = [m[metric] for m in per_seed]
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            self._tell(number, TrialState.FAIL, outcome="diverged", attrs=attrs,
                       message=f"{metric} = {values}")
            log.info("trial %d (%s): diverged (%s = %s)", number, key, metric, values)
            return
        value = sum(values) / len(values)
        self._tell(number, TrialState.COMPLETE, value=value, outcome="complete", attrs=attrs)
        log.info("trial %d (%s): %s = %s", number, key, metric, format_value(float(value)))

    def _tell(self, number: int, state: TrialState, *, value: float | None = None,
              outcome: str, message: str = "", attrs: dict | None = None) -> None:
        """Record attrs, then tell. A trial someone else finished meanwhile is left alone."""
        frozen = self.study._storage.get_trial(
            self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number))
        if frozen.state.is_finished():
            log.info("trial %d was finished by another driver meanwhile", number)
            return
        storage = self.study._storage
        for name, val in {**(attrs or {}), ATTR_OUTCOME: outcome,
                          "message": message[-4000:]}.items():
            storage.set_trial_user_attr(frozen._trial_id, name, val)
        self.study.tell(number, value if state == TrialState.COMPLETE else None, state=state,
                        skip_if_finished=True)

    # ------------------------------------------------------------------------------ public
    def _driver_lock_path(self, driver_id: str) -> Path:
        return self.study_dir / "drivers" / (driver_id.replace(":", "_") + ".lock")

    def run(self) -> Summary:
        """Work until the study is finished (or SIGINT/SIGTERM); return the final counts."""
        grid_logger = logging.getLogger("optuna.samplers._grid")
        if not any(isinstance(f, _GridRepeatFilter) for f in grid_logger.filters):
            grid_logger.addFilter(_GridRepeatFilter())
        lock_path = self._driver_lock_path(self.driver_id)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        threads = [threading.Thread(target=self._worker, args=(i,), name=f"sweep-worker-{i}")
                   for i in range(self.opts.workers)]
        interrupted = False
        try:
            for th in threads:
                th.start()
            for th in threads:
                while th.is_alive():
                    th.join(timeout=0.5)
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: stopping the running trials (re-run to continue)")
            self.stop.set()
            for th in threads:
                th.join()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            os.close(lock_fd)
            lock_path.unlink(missing_ok=True)
        result = self.summary()
        result.interrupted = interrupted or self.stop.is_set()
        return result


class _Ticker:
    """Called while a trial's process lives: heartbeat, intermediate values and pruning (by
    global step, from the TensorBoard events rank 0 writes), interruption."""

    def __init__(self, driver: Driver, trial_id: int, trial: Trial | None,
                 reader: ScalarReader | None):
        self.driver, self.trial_id, self.trial, self.reader = driver, trial_id, trial, reader
        self.last_beat = self.last_poll = time.monotonic()
        self.reported = -1

    def report(self) -> bool:
        """Report the values logged since the last call; True if there were any."""
        if self.reader is None:
            return False
        tag = self.driver.spec.prune.tag
        new = {s: v for s, v in self.reader.scalars(tag).items() if s > self.reported}
        for step, value in new.items():
            self.trial.report(value, step)
            self.reported = step
        return bool(new)

    def __call__(self) -> str | None:
        spec = self.driver.spec
        if self.driver.stop.is_set():
            return "interrupted"
        now = time.monotonic()
        if now - self.last_beat >= spec.retry.heartbeat_s:
            self.last_beat = now
            try:
                self.driver.study._storage.set_trial_user_attr(self.trial_id, ATTR_BEAT,
                                                               time.time())
            except Exception as err:  # a storage hiccup must not kill a long run
                log.warning("heartbeat of trial id %d failed: %s", self.trial_id, err)
        if self.reader is not None and now - self.last_poll >= spec.prune.poll_s:
            self.last_poll = now
            if self.report() and self.trial.should_prune():
                return "pruned"
        return None


def trial_command(spec: SweepSpec, point: Point, seed: int, run_dir: Path, *, trial: int = 0,
                  devices: Sequence[str] = (), worker: int = 0):
    """The argv, environment and fingerprint of one run (the launch template filled in)."""
    overrides = list(spec.overrides) + point.overrides()
    fields = {**spec.launch.vars, "python": sys.executable,
              "experiment": spec.experiment_of(point), "overrides": " ".join(overrides),
              "seed": seed, "run_dir": str(run_dir), "study": spec.study, "trial": trial,
              "nproc": spec.launch.nproc, "devices": ",".join(devices), "worker": worker}
    argv = launch.build_command(spec.launch.command, fields, overrides)
    env = {**os.environ, **{k: str(v) for k, v in spec.launch.env.items()}}
    if spec.launch.devices_per_trial:
        env[spec.launch.device_env] = fields["devices"]
    fingerprint = {"experiment": fields["experiment"], "overrides": overrides, "seed": seed}
    return argv, env, fingerprint


def _mean_metrics(per_seed: Sequence[dict]) -> dict:
    """Mean over seeds of the numeric keys present in every seed's metrics."""
    keys = set.intersection(*(set(m) for m in per_seed))
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in per_seed]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals) / len(vals)
    return out
