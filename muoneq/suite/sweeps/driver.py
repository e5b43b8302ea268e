"""The sweep driver: Optuna ask/tell over trial *processes*, resumable and loss-free.

Each Optuna trial is one run (a grid point with one seed) or, for an open TPE search, one
configuration evaluated on every seed (told their mean). Any number of drivers (``--workers``
threads in one process, several processes, several machines on one RDB storage) share a study:

* **the plan**: a grid's or a coordinate descent's points come from
  :func:`muoneq.suite.sweeps.plan.make_plan`, a pure function of the finished runs (bracketing grows
  the grid as results come in), so every driver derives the same plan and a killed one derives
  it again; each worker takes the plan's first open run;
* **duplicates**: after ``ask`` a worker writes the run it takes into its trial, then skips it
  when the same run is already finished or claimed under a lower trial number, or taken by a
  later claim that did not see its own (so exactly one of two racing drivers goes on, whichever
  of them saw the other's claim). Skipped trials are told FAIL with ``outcome=skipped`` and are
  never counted;
* **stopping on counts**: a worker stops when every run of the grid (or ``search.n_trials``
  configurations) is finished or has used up its retries, and waits while other workers still
  hold the last runs (it takes them over if their driver dies);
* **crashes**: a trial whose driver died is recognised (same machine: the driver's lock file is
  free; other machines: no heartbeat for ``retry.stale_after_s``). If its process finished,
  its ``metrics.json`` is told; if the process still runs, the trial is adopted and waited for
  (and stopped by SIGINT or SIGTERM as the driver's own trials are: its ``trial.json`` records
  its process id and host);
  otherwise it is told FAIL and re-queued, up to ``retry.max_retries`` times. A run folder that
  already holds ``metrics.json`` is told, never run again;
* **config errors**: before the study is created or continued, the preflight checks the study's
  recorded settings, composes every point's training config, checks the objective against the
  keys its ``metrics.json`` will hold and compares existing run folders with it
  (:mod:`muoneq.suite.sweeps.validate`). A run whose process exits with status 2 (the ``muoneq``
  command's status for a mistake the user must fix: a config, data or resume error) is failed
  at once, without retries; a later driver (the same command run again, after the fix) tries it
  once more.

Optuna's ``RetryFailedTrialCallback`` and heartbeats only work inside ``study.optimize``; this
bookkeeping is their ask/tell equivalent, keyed by the run rather than the trial. The parts:
:mod:`~muoneq.suite.sweeps.study` opens the study, :mod:`~muoneq.suite.sweeps.ledger` knows what
each run holds, :mod:`~muoneq.suite.sweeps.scheduler` hands out typed jobs,
:mod:`~muoneq.suite.sweeps.runner` runs them and :mod:`~muoneq.suite.sweeps.verdict` turns their
``metrics.json`` into what Optuna is told; the driver runs the workers.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from muoneq.suite.errors import DiskFull, UserError
from muoneq.suite.files import FULL_DISK, NO_ACCESS, full_disk, no_access
from muoneq.suite.sweeps import hparams
from muoneq.suite.sweeps.eta import study_estimate
from muoneq.suite.sweeps.launch import KILL_GRACE_S, Launcher, cores, thread_defaults
from muoneq.suite.sweeps.ledger import DriverId, Ledger, Summary
from muoneq.suite.sweeps.runner import Runner
from muoneq.suite.sweeps.scheduler import Scheduler, Wait
from muoneq.suite.sweeps.spec import Launch, SweepError, SweepSpec
from muoneq.suite.sweeps.storage import FULL_DISK_THEN
from muoneq.suite.sweeps.study import open_study
from muoneq.suite.sweeps.tensorboard_view import StudyView
from muoneq.suite.sweeps.validate import point_check, preflight

log = logging.getLogger("muoneq.suite.sweeps")


@dataclass
class DriverOptions:
    storage: str | None = None  #: None: the journal file under the study folder
    workers: int = 1
    devices: list[str] | None = None  #: accelerator ids to split between workers
    runs_dir: Path = Path("runs")
    poll_s: float = 5.0  #: how often an idle worker looks for work again
    tick_s: float = 1.0  #: how often a running trial is checked


def device_slots(launch: Launch, workers: int, devices: list[str] | None) -> list[list[str]]:
    """The accelerator ids of each worker (``launch.devices_per_trial`` each; none: every
    trial sees every device)."""
    per = launch.devices_per_trial
    if workers < 1:
        raise SweepError(f"--workers must be ≥ 1 (got {workers})")
    if per == 0:
        return [[] for _ in range(workers)]
    if devices is None:
        visible = os.environ.get(launch.device_env)
        if visible:
            devices = [d for d in visible.split(",") if d]
        else:
            import torch

            devices = [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < workers * per:
        raise SweepError(
            f"--workers {workers} × launch.devices_per_trial {per} needs {workers * per} "
            f"devices, found {len(devices)} ({','.join(devices) or 'none'}); pass --devices, "
            "fewer --workers, or --set launch.devices_per_trial=0 (each trial sees every device)"
        )
    return [devices[i * per:(i + 1) * per] for i in range(workers)]


class Driver:
    """Run a sweep to completion (or until interrupted); see the module docstring."""

    def __init__(self, spec: SweepSpec, options: DriverOptions | None = None):
        self.spec = spec
        self.opts = options or DriverOptions()
        self.study_dir = Path(self.opts.runs_dir) / spec.study
        self.me = DriverId.new(self.study_dir)
        self.stop = threading.Event()
        self.slots = device_slots(spec.launch, self.opts.workers, self.opts.devices)
        self.threads = thread_defaults(spec, self.opts.workers)
        # trials forked warm: the server imports the runtime while the study is checked and
        # opened (seconds each); run() closes it
        self.launcher = Launcher(spec, self.study_dir, self.stop, self.threads)
        try:
            self.launcher.open()
            preflight(spec, self.opts.storage, self.study_dir)  # creates nothing
            self.study, storage = open_study(spec, self.opts.storage, self.study_dir)
            self.launcher.keep_log()  # the study folder exists now
            check = point_check(spec, self.study_dir) if spec.bracket is not None else None
            self.ledger = Ledger(self.study, storage, spec, self.me, self.study_dir, check)
            hparams.write_experiment(spec, self.study_dir)
            self.view = StudyView(spec, self.study_dir)  # runs by short names, for TensorBoard
            self.view.update(self.ledger.trials())
            self.scheduler = Scheduler(self.ledger, self.study_dir)
        except BaseException:  # a mistake, or Ctrl-C: no server outlives the driver
            self.launcher.close()
            raise
        self.runner = Runner(self.ledger, self.study_dir, self.slots, self.stop, self.opts.tick_s,
                             self.launcher)
        self._lock = threading.Lock()
        #: what stopped every worker: a full disk, or a file or folder out of reach
        self.failure: UserError | None = None
        self.stopped_by: int | None = None  #: the signal that stopped the sweep

    def summary(self) -> Summary:
        return self.ledger.summary()

    def _worker(self, slot: int) -> None:
        """Take and run jobs; a full disk, or a file or folder this user may not read or
        write, stops every worker and is raised by :meth:`run`."""
        try:
            while not self.stop.is_set():
                with self._lock:
                    job = self.scheduler.next_job()
                    if job is not None and not isinstance(job, Wait):
                        self.view.update(self.ledger.trials())
                if job is None:
                    return
                if isinstance(job, Wait):
                    self.stop.wait(self.opts.poll_s)
                    continue
                self.runner.execute(job, slot)
                self._progress()
        except OSError as err:
            if isinstance(err, DiskFull) or err.errno in FULL_DISK:
                self.failure = err if isinstance(err, DiskFull) else full_disk(
                    err.filename or self.study_dir, FULL_DISK_THEN)
            elif err.errno in NO_ACCESS:
                self.failure = no_access(err)
            else:
                raise
            self.stop.set()

    def _progress(self) -> None:
        """The progress line after a trial: runs done, to go, and when the study will end
        (:mod:`muoneq.suite.sweeps.eta`)."""
        with self._lock:
            s, eta = study_estimate(self.ledger, self.opts.workers)
        log.info("progress: %d/%d runs done, %d to go%s", s.done, s.total, s.pending,
                 f"; {eta.describe()}" if eta is not None else "")

    def run(self) -> Summary:
        """Work until the study is finished, or until SIGINT (Ctrl-C) or SIGTERM: then every
        running trial gets SIGTERM and is waited for while it saves its checkpoint (killed
        after :data:`~muoneq.suite.sweeps.launch.KILL_GRACE_S`); return the final counts."""
        lock_path = self.me.lock_path()
        lock_fd, previous = None, {}
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            for name, value in self.threads.items():
                log.info("each trial runs with %s=%s (%d cores / %d workers; launch.env sets "
                         "another)", name, value, cores(), self.opts.workers)
            threads = [threading.Thread(target=self._worker, args=(i,), name=f"sweep-worker-{i}")
                       for i in range(self.opts.workers)]
            previous = self._catch_signals()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            self.launcher.close()  # the warm server, started with the driver, ends with it
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if lock_fd is not None:
                os.close(lock_fd)
                lock_path.unlink(missing_ok=True)
        if self.failure is not None:
            raise self.failure
        result = self.summary()
        result.stopped_by = self.stopped_by
        return result

    def _catch_signals(self) -> dict:
        """Make SIGINT and SIGTERM stop the workers (which stop their trials); the previous
        handlers, to restore. A handler rather than ``KeyboardInterrupt``: on Python < 3.13 a
        ``KeyboardInterrupt`` that lands in ``Thread.join`` marks the thread finished, and the
        driver exited while its trials ran on. Signals reach the main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame) -> None:
        if self.stopped_by is None:
            self.stopped_by = signum
            log.warning("%s: stopping the running trials; each saves its checkpoint (killed "
                        "after %.0f s)", signal.Signals(signum).name, KILL_GRACE_S)
        else:
            log.warning("%s: still waiting for the running trials to save their checkpoints",
                        signal.Signals(signum).name)
        self.stop.set()
