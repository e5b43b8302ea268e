"""Run one trial as its own process, and recognise a run folder's state after a crash.

The trial contract: the command writes ``<run dir>/metrics.json`` as its very last act on success
(TensorBoard logs go under the run folder too). The driver adds three files of its own:

* ``trial.json``: what the folder was run with (its fingerprint: experiment, overrides, seed), so
  a result is never reused for different settings, and where: the host, and the process id once
  it started, so that a driver that adopts the run after its own driver died can stop it
  (:func:`stop_holder`);
* ``trial.log``: the process's stdout and stderr, one header per attempt;
* ``.trial.lock``: an exclusive ``flock`` taken by the driver and *inherited by the trial
  process*: it stays held while the process lives, even if the driver is killed, so a restarted
  driver can tell "still running" (adopt it) from "died" (retry it) without guessing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO

from muoneq.suite.files import atomic_write
from muoneq.suite.runtime.metrics import HPARAMS_ENV, METRICS_FILE
from muoneq.suite.sweeps.spec import Point, SweepSpec

#: Inductor's cache of compiled kernels (Triton's included), shared by a study's trials
COMPILE_CACHE_ENV, COMPILE_CACHE = "TORCHINDUCTOR_CACHE_DIR", "compile_cache"
RECORD_NAME = "trial.json"
LOG_NAME = "trial.log"
LOCK_NAME = ".trial.lock"
#: seconds between SIGTERM and SIGKILL when a run is stopped
KILL_GRACE_S = 20.0


class ResultMismatch(RuntimeError):
    """A run folder holds a result made with other settings than the ones asked for, or a
    ``trial.json`` that cannot be read (``run_dir``: the folder; a retry cannot help)."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = Path(run_dir)


@dataclass
class Outcome:
    """How a run ended: ``complete``, ``failed``, ``pruned``, ``interrupted``, ``timeout``, or
    ``busy`` (another live process holds the folder)."""

    status: str
    metrics: dict | None = None
    returncode: int | None = None
    message: str = ""


def build_command(
    template: str, fields: Mapping[str, object], overrides: Sequence[str]
) -> list[str]:
    """Split the template into words, fill ``{placeholders}``, expand ``{overrides}`` in place."""
    argv: list[str] = []
    for word in shlex.split(template):
        if word == "{overrides}":
            argv.extend(overrides)
        else:
            argv.append(word.format(**fields))
    return argv


#: the environment variable of a trial's CPU threads (torch's intra-op pool)
THREADS_ENV = "OMP_NUM_THREADS"


def cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset``, a container's
    cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def thread_defaults(spec: SweepSpec, workers: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``workers`` trials at once on this machine: its cores
    shared out (at torch's default, every trial would start a thread per core and they would
    all wait on each other), unless the environment or ``launch.env`` sets it; nothing for one
    worker."""
    if workers < 2 or THREADS_ENV in os.environ or THREADS_ENV in spec.launch.env:
        return {}
    return {THREADS_ENV: str(max(1, cores() // workers))}


def trial_env(spec: SweepSpec, devices: Sequence[str] = (),
              env_defaults: Mapping[str, str] = MappingProxyType({}),
              study_dir: Path | None = None) -> dict[str, str]:
    """The environment of a trial on ``devices`` (see :func:`trial_command`)."""
    # the sweep writes the HParams view of its runs (muoneq.suite.sweeps.hparams)
    env = {**env_defaults, **os.environ, HPARAMS_ENV: "0",
           **{k: str(v) for k, v in spec.launch.env.items()}}
    if spec.launch.devices_per_trial:
        env[spec.launch.device_env] = ",".join(devices)
    if study_dir is not None:
        env.setdefault(COMPILE_CACHE_ENV, str(Path(study_dir).resolve() / COMPILE_CACHE))
    return env


def trial_command(spec: SweepSpec, point: Point, seed: int, run_dir: Path, *, trial: int = 0,
                  devices: Sequence[str] = (), worker: int = 0,
                  env_defaults: Mapping[str, str] = MappingProxyType({}),
                  study_dir: Path | None = None):
    """The argv, environment and fingerprint of one run (the launch template filled in;
    ``env_defaults`` under the environment and ``launch.env``: :func:`thread_defaults`). With
    ``study_dir``, the environment points ``torch.compile``'s cache at its ``compile_cache/``
    (:data:`COMPILE_CACHE_ENV`; a value of the user's, in the environment or ``launch.env``,
    wins): a compiled trial stores its kernels there and the next ones load them instead of
    compiling again."""
    overrides = list(spec.overrides) + point.overrides()
    fields = {**spec.launch.vars, "python": sys.executable,
              "experiment": spec.experiment_of(point), "overrides": " ".join(overrides),
              "seed": seed, "run_dir": str(run_dir), "study": spec.study, "trial": trial,
              "nproc": spec.launch.nproc, "devices": ",".join(devices), "worker": worker}
    argv = build_command(spec.launch.command, fields, overrides)
    env = trial_env(spec, devices, env_defaults, study_dir)
    fingerprint = {"experiment": fields["experiment"], "overrides": overrides, "seed": seed}
    return argv, env, fingerprint


def read_metrics(run_dir: Path) -> dict | None:
    """The run's ``metrics.json`` as a dict, or None when absent or not (yet) complete JSON."""
    path = Path(run_dir) / METRICS_FILE
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def check_trial_fingerprint(run_dir: Path, fingerprint: Mapping) -> None:
    """Raise :class:`ResultMismatch` if the folder was run with other settings."""
    path = Path(run_dir) / RECORD_NAME
    if not path.exists():
        return
    try:
        recorded = json.loads(path.read_text())["fingerprint"]
    except (OSError, ValueError, TypeError, KeyError) as err:  # cut, garbage, unreadable
        raise ResultMismatch(
            f"{path} is damaged or unreadable ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}), so what {run_dir} was run with cannot be "
            "checked; restore it, or delete that run folder to run its point again",
            run_dir) from None
    if recorded != json.loads(json.dumps(fingerprint)):
        raise ResultMismatch(
            f"{run_dir} was run with {recorded}, not {dict(fingerprint)}; remove the folder or "
            "give the sweep another study name", run_dir)


def is_active(run_dir: Path) -> bool:
    """True while a process (of any driver, dead or alive) still holds the folder's lock."""
    return lock_is_held(Path(run_dir) / LOCK_NAME)


def lock_is_held(path: Path) -> bool:
    """True while some process holds an ``flock`` on ``path`` (False if it does not exist)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we may have taken
    return False


def append_log(run_dir: Path, line: str) -> None:
    """Add a line of the driver's own to the run's ``trial.log``."""
    with (Path(run_dir) / LOG_NAME).open("a") as fh:
        fh.write(line.rstrip("\n") + "\n")


def log_tail(run_dir: Path, lines: int = 15) -> str:
    path = Path(run_dir) / LOG_NAME
    if not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(max(0, path.stat().st_size - 8192))
        text = fh.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class Spawned(subprocess.Popen):
    """A trial process started as its command, in a session of its own."""

    how = "spawned"

    def killpg(self, signum: int) -> None:
        """Signal its process group (it is not reaped before :meth:`wait` returns)."""
        os.killpg(self.pid, signum)


def spawn(argv: Sequence[str], env: Mapping[str, str], out: IO[bytes], lock_fd: int) -> Spawned:
    """Start ``argv`` with its output to ``out``, holding the lock ``lock_fd``."""
    return Spawned(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                   env=dict(env), start_new_session=True, pass_fds=(lock_fd,))


def _stop(proc) -> None:
    """SIGTERM the trial's process group, SIGKILL it after :data:`KILL_GRACE_S`."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            proc.killpg(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


#: why the driver stopped a trial's process, by :class:`Outcome` status
STOPPED_BY = {"interrupted": "the sweep was interrupted", "pruned": "Optuna's pruner stopped it",
              "timeout": "it ran past launch.timeout_s"}


def stopped_message(reason: str, how: str, tail: str) -> str:
    """One short line on a process the driver stopped: why, how it ended (``how``), and its
    own last ``muoneq:`` line (where it saved its step), if any, without its run folder and the
    command that continues it (~600 characters: the sweep continues it, and the driver prints
    its own command once); ``trial.log`` holds the rest."""
    said = [line for line in tail.splitlines() if line.startswith("muoneq: ")]
    own = re.sub(r"^(muoneq: training) of \S+", r"\1", said[-1]).split("; continue it")[0] \
        if said else ""
    return f"{STOPPED_BY[reason]}; {how}" + (f": {own}" if own else "")


def exit_words(proc) -> str:
    """How a trial's process ended, in words: its exit status, or that it is unknown (a warm
    trial whose server died: :mod:`muoneq.suite.sweeps.warm`)."""
    if proc.returncode is None:
        return "ended; its exit status was lost with the warm server that forked it"
    return f"exited with status {proc.returncode}"


#: what starts a trial's process: ``start(argv, env, out, lock_fd)`` (:func:`spawn`, or
#: :meth:`muoneq.suite.sweeps.warm.Launcher.start`), a process with ``pid``, ``returncode``,
#: ``wait(timeout)``, ``killpg(signum)`` and ``how`` it started
Start = Callable[[Sequence[str], Mapping[str, str], IO[bytes], int], object]


def run_process(
    argv: Sequence[str],
    run_dir: Path,
    *,
    env: Mapping[str, str],
    fingerprint: Mapping,
    on_tick: Callable[[], str | None],
    tick_s: float = 1.0,
    timeout_s: float | None = None,
    start: Start = spawn,
) -> Outcome:
    """Run ``argv`` for ``run_dir`` (started by ``start``) and return its :class:`Outcome`.

    ``on_tick`` is called about every ``tick_s`` seconds while the process runs (heartbeats,
    pruning); returning ``"pruned"`` or ``"interrupted"`` stops the process group.
    """
    from muoneq.suite.sweeps.warm import Interrupted

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_trial_fingerprint(run_dir, fingerprint)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return Outcome("busy", message=f"{run_dir} is held by a live process")
    try:
        record = {"fingerprint": fingerprint, "argv": list(argv), "host": socket.gethostname(),
                  "started": time.time()}
        atomic_write(run_dir / RECORD_NAME, json.dumps(record, indent=1))
        with (run_dir / LOG_NAME).open("ab") as log:
            log.write(f"\n=== {time.strftime('%F %T')} {shlex.join(argv)}\n".encode())
            log.flush()
            try:
                proc = start(argv, env, log, fd)
            except Interrupted as err:
                return Outcome("interrupted", message=str(err))
            record.update(pid=proc.pid, process=proc.how)
            try:
                atomic_write(run_dir / RECORD_NAME, json.dumps(record, indent=1))
            except BaseException:  # never leave a process running that no record names
                _stop(proc)
                raise
            start_time, reason = time.monotonic(), None
            while True:
                try:
                    proc.wait(timeout=tick_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if timeout_s is not None and time.monotonic() - start_time > timeout_s:
                    reason = "timeout"
                else:
                    reason = on_tick()
                if reason:
                    _stop(proc)
                    break
    finally:
        os.close(fd)
    metrics = read_metrics(run_dir)
    tail = log_tail(run_dir)
    if reason:
        return Outcome(reason, metrics, proc.returncode, stopped_message(
            reason, f"the process {exit_words(proc)}", tail))
    if metrics is not None:  # metrics.json is the trial's last act: it marks success
        return Outcome("complete", metrics, proc.returncode)
    why = f"exited 0 without writing {METRICS_FILE}" if proc.returncode == 0 else (
        exit_words(proc))
    return Outcome("failed", None, proc.returncode, f"{why}\n{tail}".strip())


def wait_for_release(
    run_dir: Path, *, on_tick: Callable[[], str | None], tick_s: float = 1.0
) -> Outcome:
    """Adopt a run whose driver died while its process lives on: wait for it, read its result.
    Interrupted, stop it as :func:`run_process` stops its own (:func:`stop_holder`); a process
    this driver cannot stop (its pid unrecorded) is left running, and said so."""
    while is_active(run_dir):
        reason = on_tick()
        if reason:
            pid = stop_holder(run_dir) if reason == "interrupted" else None
            if pid is None:
                return Outcome(reason, message="stopped waiting for an adopted run, left "
                                               "running: no id of its process on this machine "
                                               "is recorded")
            return Outcome(reason, read_metrics(run_dir), message=stopped_message(
                reason, f"its process {pid}, adopted from a driver that died, was stopped",
                log_tail(run_dir)))
        time.sleep(tick_s)
    metrics = read_metrics(run_dir)
    if metrics is not None:
        return Outcome("complete", metrics)
    return Outcome("failed",
                   message=f"adopted run ended without {METRICS_FILE}\n{log_tail(run_dir)}")


def holder(run_dir: Path) -> int | None:
    """The id of the live process that holds ``run_dir`` (its lock) when ``trial.json`` records
    it and it runs on this machine, else None. The id is checked against the process itself,
    so that a reused id (the process ended) is never taken for it: on Linux the process must
    have the folder's lock file open; elsewhere it must lead a process group of its own, as
    a trial does (it starts in a session of its own)."""
    try:
        record = json.loads((Path(run_dir) / RECORD_NAME).read_text())
        pid, host = record.get("pid"), record.get("host")
    except (OSError, ValueError, AttributeError):  # gone, damaged: nothing to go by
        return None
    if not isinstance(pid, int) or host != socket.gethostname() or not is_active(run_dir):
        return None
    if not Path("/proc/self/fd").is_dir():
        try:
            return pid if os.getpgid(pid) == pid else None
        except ProcessLookupError:
            return None
    lock = os.path.realpath(Path(run_dir) / LOCK_NAME)
    try:
        opened = [os.path.realpath(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:  # gone, or another user's
        return None
    return pid if lock in opened else None


def stop_holder(run_dir: Path, grace_s: float = KILL_GRACE_S, poll_s: float = 0.1) -> int | None:
    """Stop the process that holds ``run_dir`` (:func:`holder`) as the driver stops its own
    trials: SIGTERM to its process group (it saves its step), SIGKILL when the folder is still
    held ``grace_s`` later; waits until it is released. Its id, or None when there is none this
    driver may stop (another machine's, or unrecorded: a run started by an older version)."""
    pid = holder(run_dir)
    if pid is None:
        return None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while is_active(run_dir) and time.monotonic() < deadline:
            time.sleep(poll_s)
        if not is_active(run_dir):
            break
    return pid
