"""Carry out a job: run a trial's processes (one per seed) or wait for an adopted one, keep
the trial alive in the study meanwhile, and record how it ended.

While a process runs, a :class:`Ticker` heartbeats the trial, reports the values rank 0 logs to
TensorBoard (by global step) for pruning, and stops the process when the driver is interrupted.
A run folder that already holds ``metrics.json`` (made with the same settings) is told, never
run again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import optuna
from optuna.trial import TrialState

from muoneq.suite.errors import DiskFull
from muoneq.suite.sweeps import launch
from muoneq.suite.sweeps.events import ScalarReader
from muoneq.suite.sweeps.ledger import Ledger
from muoneq.suite.sweeps.scheduler import Adopt, Job, Start
from muoneq.suite.sweeps.trial_record import TrialRecord
from muoneq.suite.sweeps.verdict import judge

log = logging.getLogger("muoneq.suite.sweeps")


class Runner:
    """Runs jobs for the workers of one driver; ``slots[i]`` are worker ``i``'s devices."""

    def __init__(self, ledger: Ledger, study_dir: Path, slots: Sequence[Sequence[str]],
                 stop: threading.Event, tick_s: float, launcher: launch.Launcher):
        self.ledger, self.spec = ledger, ledger.spec
        self.study_dir, self.slots, self.stop, self.tick_s = study_dir, slots, stop, tick_s
        #: how trials start (forked warm or spawned: launch.warm), and from which environment
        self.launcher = launcher

    def execute(self, job: Job, slot: int) -> None:
        try:
            outcomes = self._adopt(job) if isinstance(job, Adopt) else self._start(job, slot)
        except launch.ResultMismatch as err:  # a retry would meet the same folder
            self.ledger.tell(job.number, TrialState.FAIL, outcome="config_error",
                             message=str(err))
            log.error("trial %d (%s): %s (not retried: fix it, then re-run the sweep)",
                      job.number, job.key, err)
            launch.append_log(err.run_dir, f"muoneq sweep: trial {job.number} failed: {err}")
            return
        if outcomes is None:
            return
        full = [o for o in outcomes if o.returncode == DiskFull.exit_code]
        if full:  # every other run would meet the same disk: stop the sweep at once
            self.ledger.tell(job.number, TrialState.FAIL, outcome="disk_full",
                             message=full[0].message)
            raise disk_full(job, full[0].message)
        verdict = judge(outcomes, job.seeds, self.spec.objective.metric)
        if verdict.missing_metric:  # the run itself succeeded: say why the trial failed
            for seed in job.seeds:
                launch.append_log(job.point.run_dir(self.study_dir, seed),
                                  f"muoneq sweep: trial {job.number} failed: {verdict.message}")
        self.ledger.record(job.number, job.key, verdict)

    def _adopt(self, job: Adopt) -> list[launch.Outcome] | None:
        """Wait for the adopted processes (interrupted, stopped as this driver's own); None
        when interrupted while one this driver could not stop runs on (the trial is left for
        the next driver)."""
        tick = Ticker(self, job.number)
        outcomes = []
        for seed in job.seeds:
            run_dir = job.point.run_dir(self.study_dir, seed)
            outcome = launch.wait_for_release(run_dir, on_tick=tick, tick_s=self.tick_s)
            if outcome.status == "interrupted" and launch.is_active(run_dir):
                return None
            outcomes.append(outcome)
            if outcome.status != "complete":
                break
        return outcomes

    def _start(self, job: Start, slot: int) -> list[launch.Outcome]:
        outcomes: list[launch.Outcome] = []
        for i, seed in enumerate(job.seeds):
            run_dir = job.point.run_dir(self.study_dir, seed)
            argv, env, fingerprint = launch.trial_command(
                self.spec, job.point, seed, run_dir, trial=job.number, devices=self.slots[slot],
                worker=slot, env_defaults=self.launcher.env_defaults, study_dir=self.study_dir,
                environ=self.launcher.environ)
            metrics = launch.read_metrics(run_dir)
            if metrics is not None:
                launch.check_trial_fingerprint(run_dir, fingerprint)
                log.info("trial %d (%s): %s already holds metrics.json: told, not re-run",
                         job.number, job.key, run_dir)
                outcomes.append(launch.Outcome("complete", metrics))
                continue
            prune = self.spec.prune.enabled and i == 0
            tick = Ticker(self, job.number, job.trial if prune else None,
                          ScalarReader(run_dir) if prune else None)
            log.info("trial %d (%s): started on worker %d", job.number, job.key, slot)
            log.debug("trial %d: %s", job.number, " ".join(argv))  # also in its trial.log
            outcome = launch.run_process(argv, run_dir, env=env, fingerprint=fingerprint,
                                         on_tick=tick, tick_s=self.tick_s,
                                         timeout_s=self.spec.launch.timeout_s,
                                         start=self.launcher.start)
            # a live process of a lost trial owns the folder, or may (its warm server ended
            # after it was asked to fork it): whoever holds the lock is waited for
            if outcome.status in ("busy", "unknown"):
                outcome = launch.wait_for_release(run_dir, on_tick=tick, tick_s=self.tick_s)
            if outcome.status == "complete":
                tick.report()  # the whole curve, for the pruner's later comparisons
            outcomes.append(outcome)
            if outcome.status != "complete":
                break
        return outcomes


def disk_full(job: Job, log: str) -> DiskFull:
    """The sweep's :class:`DiskFull` for a run that exited with the full-disk status: its own
    ``muoneq:`` line (the file and the space left), with how the sweep continues."""
    said = [line for line in log.splitlines() if line.startswith("muoneq: ")]
    what = said[-1].removeprefix("muoneq: ").split("; then ")[0] if said else (
        f"exited with status {DiskFull.exit_code} (disk full); see its {launch.LOG_NAME}")
    return DiskFull(f"trial {job.number} ({job.key}): {what}; then run the same sweep command "
                    "to continue (the run resumes from its last checkpoint)")


class Ticker:
    """Called while a trial's process lives: heartbeat, intermediate values and pruning (by
    global step, from the TensorBoard events rank 0 writes), interruption."""

    def __init__(self, runner: Runner, number: int, trial: optuna.Trial | None = None,
                 reader: ScalarReader | None = None):
        self.runner, self.number, self.trial, self.reader = runner, number, trial, reader
        self.last_beat = self.last_poll = time.monotonic()
        self.reported = -1

    def report(self) -> bool:
        """Report the values logged since the last call; True if there were any."""
        if self.reader is None:
            return False
        tag = self.runner.spec.prune.tag
        new = {s: v for s, v in self.reader.scalars(tag).items() if s > self.reported}
        for step, value in new.items():
            self.trial.report(value, step)
            self.reported = step
        return bool(new)

    def __call__(self) -> str | None:
        spec = self.runner.spec
        if self.runner.stop.is_set():
            return "interrupted"
        now = time.monotonic()
        if now - self.last_beat >= spec.retry.heartbeat_s:
            self.last_beat = now
            try:
                self.runner.ledger.write(self.number, TrialRecord(heartbeat=time.time()))
            except Exception as err:  # a storage hiccup must not kill a long run
                log.warning("heartbeat of trial %d failed: %s", self.number, err)
        if self.reader is not None and now - self.last_poll >= spec.prune.poll_s:
            self.last_poll = now
            if self.report() and self.trial.should_prune():
                return "pruned"
        return None
