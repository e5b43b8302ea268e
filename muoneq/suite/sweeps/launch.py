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
import functools
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO

from muoneq.suite import code_version
from muoneq.suite.files import atomic_write
from muoneq.suite.runtime.metrics import HPARAMS_ENV, METRICS_FILE
from muoneq.suite.sweeps import warm
from muoneq.suite.sweeps.spec import DEFAULT_COMMAND, Point, SweepSpec, module_of
from muoneq.suite.sweeps.warm import THREADS_ENV, Interrupted, Unavailable, Unknown

log = logging.getLogger("muoneq.suite.sweeps")

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
    """How a run ended: ``complete``, ``failed``, ``pruned``, ``interrupted``, ``timeout``,
    ``busy`` (another live process holds the folder) or ``unknown`` (it may have started:
    :func:`run_process`)."""

    status: str
    metrics: dict | None = None
    returncode: int | None = None
    message: str = ""
    #: seconds from its start to its end on this driver's monotonic clock (None: it did not run
    #: here, e.g. adopted)
    seconds: float | None = None


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


@functools.cache
def torch_compile_cache() -> str:
    """The :data:`COMPILE_CACHE_ENV` torch writes into ``os.environ`` when it finds none: its
    default folder (importing ``torch._dynamo`` writes it on torch 2.14 and 2.15, a first
    compile on 2.9), which a process that imported the runtime, or was started by one, holds
    though nobody chose it."""
    # torch has no public way to ask: cache_dir_utils.default_cache_dir is the value its
    # cache_dir() writes (torch 2.9 to 2.15; 2.14 writes it made absolute)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def trial_env(spec: SweepSpec, devices: Sequence[str] = (),
              env_defaults: Mapping[str, str] = MappingProxyType({}),
              study_dir: Path | None = None,
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial on ``devices`` (see :func:`trial_command`)."""
    inherited = dict(os.environ if environ is None else environ)
    cache = inherited.get(COMPILE_CACHE_ENV)
    if cache is not None and os.path.abspath(cache) == torch_compile_cache():
        del inherited[COMPILE_CACHE_ENV]  # torch's, not the user's: the study's cache instead
    # the sweep writes the HParams view of its runs (muoneq.suite.sweeps.hparams)
    env = {**env_defaults, **inherited, HPARAMS_ENV: "0",
           **{k: str(v) for k, v in spec.launch.env.items()}}
    if spec.launch.devices_per_trial:
        env[spec.launch.device_env] = ",".join(devices)
    if study_dir is not None:
        env.setdefault(COMPILE_CACHE_ENV, str(Path(study_dir).resolve() / COMPILE_CACHE))
    return env


def trial_command(spec: SweepSpec, point: Point, seed: int, run_dir: Path, *, trial: int = 0,
                  devices: Sequence[str] = (), worker: int = 0,
                  env_defaults: Mapping[str, str] = MappingProxyType({}),
                  study_dir: Path | None = None, environ: Mapping[str, str] | None = None):
    """The argv, environment and fingerprint of one run (the launch template filled in). The
    environment: ``env_defaults`` (:func:`thread_defaults`) under ``environ`` (None: this
    process's) under ``launch.env``. With ``study_dir``, it points ``torch.compile``'s cache at
    the study's ``compile_cache/`` (:data:`COMPILE_CACHE_ENV`; a value of the user's, in
    ``environ`` or ``launch.env``, wins, and torch's default in ``environ``,
    :func:`torch_compile_cache`, is nobody's): a compiled trial stores its kernels there and
    the next ones load them instead of compiling again."""
    overrides = list(spec.overrides) + point.overrides()
    fields = {**spec.launch.vars, "python": sys.executable,
              "experiment": spec.experiment_of(point), "overrides": " ".join(overrides),
              "seed": seed, "run_dir": str(run_dir), "study": spec.study, "trial": trial,
              "nproc": spec.launch.nproc, "devices": ",".join(devices), "worker": worker}
    argv = build_command(spec.launch.command, fields, overrides)
    env = trial_env(spec, devices, env_defaults, study_dir, environ)
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
#: :meth:`Launcher.start`), a process with ``pid``, ``returncode``,
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
    A process whose start is unknown (:class:`~muoneq.suite.sweeps.warm.Unknown`) gives the
    status ``unknown``: the caller waits for whoever holds the folder's lock, as for an adopted
    run.
    """
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
            began = time.monotonic()
            try:
                proc = start(argv, env, log, fd)
            except Interrupted as err:
                return Outcome("interrupted", message=str(err))
            except Unknown as err:
                return Outcome("unknown", message=str(err))
            record.update(pid=proc.pid, process=proc.how)
            try:
                atomic_write(run_dir / RECORD_NAME, json.dumps(record, indent=1))
            except BaseException:  # never leave a process running that no record names
                _stop(proc)
                raise
            reason = None
            while True:
                try:
                    proc.wait(timeout=tick_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if timeout_s is not None and time.monotonic() - began > timeout_s:
                    reason = "timeout"
                else:
                    reason = on_tick()
                if reason:
                    _stop(proc)
                    break
    finally:
        os.close(fd)
    seconds = time.monotonic() - began
    metrics = read_metrics(run_dir)
    tail = log_tail(run_dir)
    if reason:
        return Outcome(reason, metrics, proc.returncode, stopped_message(
            reason, f"the process {exit_words(proc)}", tail), seconds)
    if metrics is not None:  # metrics.json is the trial's last act: it marks success
        return Outcome("complete", metrics, proc.returncode, seconds=seconds)
    why = f"exited 0 without writing {METRICS_FILE}" if proc.returncode == 0 else (
        exit_words(proc))
    return Outcome("failed", None, proc.returncode, f"{why}\n{tail}".strip(), seconds)


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


# ----------------------------------------------------------------------------- warm or spawned
def visible_gpus() -> int:
    """The CUDA devices this machine shows (NVML's count: CUDA is not initialized)."""
    import torch

    return torch.cuda.device_count()


def warm_module(spec: SweepSpec) -> tuple[str | None, str]:
    """The module this sweep's trials run warm (:mod:`muoneq.suite.sweeps.warm`), or None
    (they are spawned), and why: ``launch.warm=auto`` forks the default command's trials on a
    machine without a GPU, where a trial lasts seconds to minutes and its imports are a large
    share of it; where a GPU is visible trials last minutes to hours, the seconds saved are
    noise, and they are spawned (docs/sweeps.md)."""
    launch = spec.launch
    if launch.warm == "false":
        return None, "launch.warm=false"
    if launch.warm == "auto" and launch.command != DEFAULT_COMMAND:
        return None, ("launch.warm=auto forks only trials of the default launch.command; "
                      "launch.warm=true forks a `{python} -m MODULE …` command too")
    if launch.warm == "auto" and (gpus := visible_gpus()):
        return None, (f"launch.warm=auto spawns the trials of a machine with a GPU ({gpus} "
                      "visible), which last long enough that their imports hardly count; "
                      "launch.warm=true forks them")
    unsupported = warm.supported()
    if unsupported is not None:
        return None, f"launch.warm={launch.warm}, but {unsupported}"
    return module_of(launch.command), f"launch.warm={launch.warm}"


def describe_start(module: str | None, why: str) -> str:
    """How trials start (:func:`warm_module`'s answer), in words."""
    if module is None:
        return f"each trial is spawned as its own command ({why})"
    return f"trials start warm: one server imports the runtime once and forks each trial ({why})"


class Launcher:
    """How one driver starts its trials: forked by a warm server (:class:`warm.Server
    <muoneq.suite.sweeps.warm.Server>`, :func:`warm_module`), or spawned as their command; the
    choice and every fallback are logged, and each trial's log and ``trial.json`` say how it
    started. A trial is forked only by a server that imported the code the checkout holds at the
    fork (:mod:`muoneq.suite.code_version`): when it changed, a new server is started (the old
    one's trials run on), and a trial is spawned when the code changed again meanwhile."""

    def __init__(self, spec: SweepSpec, study_dir: Path, stop: threading.Event,
                 env_defaults: Mapping[str, str]) -> None:
        self.spec, self.study_dir, self.stop = spec, Path(study_dir), stop
        self.env_defaults = dict(env_defaults)
        #: the environment the server and every trial start from: the driver's as it started,
        #: before the preflight's imports change it (torch rewrites TORCHINDUCTOR_CACHE_DIR:
        #: its default where none, a relative path made absolute), which would differ from the
        #: server's and leave every trial spawned
        self.environ = dict(os.environ)
        self.module, self.why = warm_module(spec)
        self.server: warm.Server | None = None
        #: servers replaced after the checkout changed, closed once their trials ended
        self.retired: list[warm.Server] = []
        self.failed = 0  #: servers that ended on their own
        self._keep_log = False  #: servers' output goes to the study's log (:meth:`keep_log`)
        self._lock = threading.Lock()

    def describe(self) -> str:
        """One line for the driver's log: how trials start, and why."""
        return describe_start(self.module, self.why)

    def open(self) -> None:
        """Start the server, when trials run warm: its imports run while the driver checks and
        opens the study; its output is held until :meth:`keep_log`."""
        if self.module is not None:
            with self._lock:
                self._new_server()

    def keep_log(self) -> None:
        """Say how trials start, and write the servers' output to the study's
        :data:`~muoneq.suite.sweeps.warm.SERVER_LOG` from now on (once the study folder exists:
        a sweep whose preflight fails creates nothing, and says only why)."""
        log.info("%s", self.describe())
        with self._lock:
            self._keep_log = True
            if self.server is not None:
                self.server.keep_log()

    def close(self) -> None:
        with self._lock:
            for server in [self.server, *self.retired]:
                if server is not None:
                    server.close()
            self.server, self.retired = None, []

    def _new_server(self) -> warm.Server:
        env = trial_env(self.spec, (), self.env_defaults, self.study_dir, self.environ)
        env.pop(self.spec.launch.device_env, None)  # each trial's own, read after the fork
        self.server = warm.Server(self.module, env, self.study_dir / warm.SERVER_LOG)
        self.server.start()
        if self._keep_log:
            self.server.keep_log()
        return self.server

    def _ready(self) -> warm.Server | None:
        """The server to fork with, ready (a new one if the last ended or was replaced), or
        None: spawn."""
        with self._lock:
            for old in [s for s in self.retired if not s.running()]:
                old.close()
                self.retired.remove(old)
            server = self.server
            if self.module is None:
                return None
            if server is None or server.dead.is_set():
                if server is not None:
                    self.failed += 1
                    if self.failed >= warm.MAX_FAILED_SERVERS:
                        self._give_up(f"{server.failure}, and {self.failed} servers ended so far")
                        return None
                    log.warning("%s; its trials that still run go on and are waited for; "
                                "starting a new warm server", server.failure)
                    server.close()
                server = self._new_server()
        try:
            server.wait_ready(self.stop)
        except Unavailable as err:
            with self._lock:
                if server.ready.is_set() or self.module is None:
                    return None  # it died after its start: the next trial starts a new one
                self._give_up(str(err))
            return None
        if not server.announced:
            server.announced = True
            log.info("warm server ready (pid %s): %s; it runs %s", server.pid, server.imported,
                     server.version.describe())
        return server

    def _server(self) -> tuple[warm.Server | None, str | None]:
        """The ready server at the checkout's code now, or None and why the trial is spawned
        (None: trials are not warm)."""
        server = self._ready()
        changed = None if server is None else self._changed(server)
        if changed is None:
            return server, None
        with self._lock:
            if self.server is server:
                log.warning("%s: a new warm server imports it for the next trials (the trials "
                            "the old one forked run on)", changed)
                self.retired.append(server)
                self.server = None
        server = self._ready()
        again = None if server is None else self._changed(server)
        if again is None:
            return server, None
        return None, f"{again}: the code changed again while a new warm server imported"

    @staticmethod
    def _changed(server: warm.Server) -> str | None:
        """How the checkout's code differs from what ``server`` imported, or None."""
        now = code_version.current(Path(server.version.checkout))
        if now.same_code(server.version):
            return None
        return (f"the checkout is at {now.describe()}, and the warm server (pid {server.pid}) "
                f"imported {server.version.describe()}")

    def _give_up(self, why: str) -> None:
        """Spawn every later trial (called under the lock)."""
        self.module = None
        self.why = f"warm trials stopped: {why}; see {self.study_dir / warm.SERVER_LOG}"
        log.warning("%s", self.why)

    def _difference(self, server: warm.Server, env: Mapping[str, str]) -> str | None:
        """Why a trial with ``env`` cannot be forked by ``server``: a process reads its
        environment when it starts (and torch at its import), so only the devices may differ."""
        keys = {k for k in env.keys() | server.env.keys() if env.get(k) != server.env.get(k)}
        keys.discard(self.spec.launch.device_env)
        if keys:
            return (f"its environment differs from the warm server's in {', '.join(sorted(keys))}, "
                    "which a process reads when it starts")
        if os.getcwd() != server.cwd:
            return f"the driver's working folder is not the warm server's ({server.cwd})"
        return None

    def start(self, argv: Sequence[str], env: Mapping[str, str], out: IO[bytes],
              lock_fd: int):
        """Start the trial ``argv`` with its output to ``out`` (its open ``trial.log``) and
        holding ``lock_fd``: forked warm, else spawned (the reason in its log when it was meant
        to be warm); :class:`~muoneq.suite.sweeps.warm.Interrupted` when the sweep stopped
        first, :class:`~muoneq.suite.sweeps.warm.Unknown` when its server ended after it was
        asked to fork it (it is never started again)."""
        server, why = self._server()
        if server is not None:
            why = self._difference(server, env)
            if why is None:
                note = f"--- forked by the warm server (pid {server.pid})\n"
                out.write(note.encode())
                out.flush()
                try:
                    return server.fork(argv, self.module, env, out.fileno(), lock_fd)
                except Unknown as err:
                    out.write(f"--- {err}: it is not started again; its lock and metrics.json "
                              "decide\n".encode())
                    out.flush()
                    raise
                except Unavailable as err:
                    why = f"the warm server could not fork it: {err}"
        if why is not None:
            log.warning("trial %s is spawned: %s", shlex.join(argv[3:5]), why)
            out.write(f"--- spawned: {why}\n".encode())
            out.flush()
        return spawn(argv, env, out, lock_fd)
