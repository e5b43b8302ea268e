"""Warm trials: a server that imports the runtime once and forks one process per trial.

A trial of the default launch command (``{python} -m muoneq train …``) used to pay seconds of
imports (torch, Lightning, the tasks) before its first step, and about a second of interpreter
exit after it: on the demo's 100-step trials, a third of their time (docs/performance.md). With
``launch.warm`` (:func:`warm_choice`), a driver starts one *server*, a process of its own that
imports them once; for each trial it forks a fresh child that runs the trial's module as
``python -m`` would (:func:`runpy.run_module`, the trial's argv as ``sys.argv``) with the trial's
environment, working folder, output (its ``trial.log``, as stdout and stderr) and lock
(``.trial.lock``), the two files sent over a Unix socket (``SCM_RIGHTS``).

multiprocessing's ``forkserver`` (with ``set_forkserver_preload``) forks the same way but runs
functions of its caller, not programs with their own argv, environment, output and lock, hence
the few lines here. What a spawned trial has, a forked one keeps:

* **a process of its own**: a crash or a kill ends it alone; it leads a session of its own
  (``setsid``), so the driver signals its process group as before (through the server, which
  never signals a child it has already reaped: a pid is not reused while it is a zombie);
* **the lock**: the driver's own open file description of ``.trial.lock``, so the kernel holds
  the lock while the trial lives, whatever dies first (driver, server), and a later driver
  adopts the live trial as before (:func:`muoneq.suite.sweeps.launch.is_active`);
* **its start state**: the environment is the trial's (``os.environ``: children it spawns and
  every later read see it), and a trial whose environment differs from the server's in more
  than its devices is spawned (:meth:`Launcher.start`); torch's CPU threads, which torch sizes
  from ``OMP_NUM_THREADS`` when it is imported, are set (``torch.set_num_threads``) to the
  trial's value, or to what torch chooses without one (asked once of a new process); the random
  state is a new process's (Python's and NumPy's reseeded, torch's default generator at its
  initial seed);
* **its end**: as the interpreter ends (non-daemon threads joined, ``atexit`` handlers run,
  output flushed), without freeing every module one by one (``os._exit``: a second per trial).

If the server dies, its running trials live on, each still holding its lock: the driver watches
them through a pidfd (sent by the server at the fork; ``os.pidfd_open``, Linux ≥ 5.3), their
exit status is unknown and their ``metrics.json`` decides, as for an adopted run; the next trial
starts a new server (up to :data:`MAX_SERVERS`, then trials are spawned).

Threads: a process forked while another of its threads runs gets a copy of the calling thread
only, and whatever the others held stays held in it (an OpenMP pool forked after it worked
hangs the child's next parallel region). torch's import starts a second thread when it may use
more than one CPU thread, so the server imports with ``OMP_NUM_THREADS=1``, checks that it runs
one thread before every fork, and each child sizes its own pool.

CUDA: the server must never initialize CUDA (nor call ``torch.cuda.is_available()``, which
initializes its driver): a CUDA driver does not survive ``fork`` (torch marks the children, and
their first CUDA call fails with "Cannot re-initialize CUDA in forked subprocess"). The server
imports only, and checks in a forked probe that a child could still use CUDA
(``torch.cuda._is_in_bad_fork``) before it says it is ready; otherwise trials are spawned. The
devices a trial sees (``CUDA_VISIBLE_DEVICES``) are read by its own CUDA initialization, after
the fork.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # the server imports nothing of the sweep's own (a trial would inherit it)
    from muoneq.suite.sweeps.spec import SweepSpec

log = logging.getLogger("muoneq.suite.sweeps")

#: the module whose command the server preloads the runtime for (``{python} -m muoneq …``)
RUNTIME_MODULE = "muoneq"
#: servers one driver starts at most (a server that died is replaced; then trials are spawned)
MAX_SERVERS = 3
#: seconds a server may take to import before trials are spawned instead
READY_TIMEOUT_S = 600.0
#: the server's output (its import warnings, why it stopped), appended, under the study folder
SERVER_LOG = "warm_server.log"
#: the largest message on the socket (a trial's argv and environment)
MAX_MESSAGE = 1 << 20
#: a trial's CPU threads: torch reads it when imported (the server imports with 1)
THREADS_ENV = "OMP_NUM_THREADS"
#: what torch chooses without ``OMP_NUM_THREADS``, asked of a new process
THREADS_PROBE = "import torch; print(torch.get_num_threads())"
#: the server's program (``-c``: ``-m`` would run a second copy of this module, which the
#: package imports)
SERVER_MAIN = "import sys; from muoneq.suite.sweeps.warm import main; sys.exit(main(sys.argv[1:]))"


class Unavailable(RuntimeError):
    """Why trials cannot be forked warm (the message is logged; they are spawned)."""


class Interrupted(RuntimeError):
    """The sweep was interrupted while a trial waited for its server: it never started."""


def supported() -> str | None:
    """Why this platform cannot run warm trials, or None when it can."""
    missing = [name for name, owner in (("fork", os), ("pidfd_open", os), ("setsid", os),
                                        ("send_fds", socket)) if not hasattr(owner, name)]
    if missing:
        return f"this platform lacks {', '.join(missing)} (warm trials need Linux ≥ 5.3)"
    return None


# ----------------------------------------------------------------------------- the socket
def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the file descriptors it carried; ``(None, [])`` at the end."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    return (json.loads(data) if data else None), fds


# ----------------------------------------------------------------------------- the server
def preload(module: str) -> None:
    """Import what a trial of ``python -m module`` imports before its work: for ``muoneq``
    the runtime (Lightning without torchmetrics' optional packages when every installed task
    allows it: :mod:`muoneq.suite.runtime.lean_imports`) and the tasks' packages; else the
    module itself (its top level: a ``-m`` module keeps its program under
    ``if __name__ == "__main__":``) or, for a package, the package (not its ``__main__``)."""
    if module != RUNTIME_MODULE:
        importlib.import_module(module)
        return
    from muoneq.suite.runtime.lean_imports import import_lightning
    from muoneq.suite.runtime.tasks import get_task, task_names

    try:
        lean = all(get_task(name).lean_imports for name in task_names())
    except (ValueError, TypeError):  # a task that cannot load: its runs will say so
        lean = False
    import_lightning(lean)
    for name in ("muoneq.suite.cli", "muoneq.suite.runtime.cli", "muoneq.suite.runtime.run"):
        importlib.import_module(name)


def _threads() -> int:
    """The threads of this process (the kernel's count: native ones included)."""
    return len(os.listdir("/proc/self/task"))


def _forkable() -> None:
    """Raise :class:`Unavailable` when a child forked now could not run a trial as a spawned
    process would: another thread runs (fork copies only the calling one, and any lock the
    others held stays locked), or a module initialized CUDA (module docstring)."""
    if _threads() != 1:
        raise Unavailable(f"the server runs {_threads()} threads after its imports, and a "
                          "process is forked safely only from one")
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_initialized():
        raise Unavailable("CUDA was initialized while the server imported")
    pid = os.fork()
    if pid == 0:  # the probe: would a forked trial be refused CUDA?
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise Unavailable("a module the server imported initialized CUDA's driver "
                          "(torch.cuda.is_available()), so forked trials could not use a GPU")


def serve(sock: socket.socket) -> int:
    """The server's loop (module docstring): preload, say ready, then fork trials, reap them
    and relay signals until the driver closes its end (the trials then run on)."""
    hello, _ = _receive(sock)
    if hello is None:
        return 0
    threads, probe = _thread_count(hello["threads"]), None
    if threads is None:  # what a trial's torch chooses, asked while the server imports
        env = {k: v for k, v in os.environ.items() if k != THREADS_ENV}
        probe = subprocess.Popen([sys.executable, "-c", THREADS_PROBE], env=env,
                                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        preload(hello["preload"])
        if probe is not None:
            threads = int(probe.communicate()[0].split()[-1])
        _forkable()
    except BaseException as err:
        traceback.print_exc()
        _send(sock, {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"})
        return 1
    _send(sock, {"ready": os.getpid(), "modules": len(sys.modules), "threads": threads})
    children: dict[int, tuple[int, int]] = {}  # pidfd → (trial id, pid), until reaped
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not sock:  # a child ended: reap it, say how
                    trial, pid = children.pop(key.fd)
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    status = os.waitpid(pid, 0)[1]
                    _reply(sock, {"id": trial, "exit": os.waitstatus_to_exitcode(status)})
                    continue
                try:
                    message, fds = _receive(sock)
                except (ConnectionError, OSError):
                    message, fds = None, []
                if message is None:  # the driver is gone: its trials live on
                    return 0
                if message["op"] == "signal":
                    _signal(children, message)
                else:
                    _fork(sock, selector, children, {**message, "threads": threads}, fds)


def _reply(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    with contextlib.suppress(OSError):  # the driver is gone: the loop ends at its next read
        _send(sock, message, fds)


def _signal(children: dict[int, tuple[int, int]], message: dict) -> None:
    """Signal a trial's process group, while it is not reaped (its pid cannot be reused)."""
    for trial, pid in children.values():
        if trial == message["id"]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, message["signum"])


def _fork(sock: socket.socket, selector: selectors.BaseSelector,
          children: dict[int, tuple[int, int]], message: dict, fds: list[int]) -> None:
    """Fork the trial ``message`` describes, with ``fds`` = (its log, its lock)."""
    try:
        _forkable_now()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except Exception as err:  # noqa: BLE001 (any reason is sent back: the trial is spawned)
        for fd in fds:
            os.close(fd)
        _reply(sock, {"id": message["id"], "error": f"{type(err).__name__}: {err}"})
        return
    if pid == 0:
        server_fds = [sock.detach(), *children]
        selector.close()
        _child(message, fds, server_fds)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pidfd] = (message["id"], pid)
    selector.register(pidfd, selectors.EVENT_READ)
    _reply(sock, {"id": message["id"], "pid": pid}, [pidfd])


def _forkable_now() -> None:
    if _threads() != 1:
        raise Unavailable(f"the server runs {_threads()} threads")


# ----------------------------------------------------------------------------- a trial's child
def _child(message: dict, fds: list[int], server_fds: list[int]) -> NoReturn:
    """Become the trial (module docstring) and exit with its status."""
    code = 1
    try:
        os.setsid()
        for fd in server_fds:
            os.close(fd)
        log_fd, lock_fd = fds
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.set_inheritable(lock_fd, True)  # as subprocess's pass_fds leaves it
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        _fresh_state(message["env"], message["threads"])
        code = _run_module(message["module"], message["args"])
    except BaseException:  # noqa: BLE001 (the child must end here, never in the server's loop)
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    _finish(code)


def _thread_count(value: str | None) -> int | None:
    """``OMP_NUM_THREADS`` as torch takes it (a positive number), or None."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _fresh_state(env: Mapping[str, str], default_threads: int) -> None:
    """What a new process would start with: torch's CPU threads (``OMP_NUM_THREADS``, which
    torch read at its import in the server, where it was 1; else torch's own choice), new
    random states."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(_thread_count(env.get(THREADS_ENV)) or default_threads)
        torch.manual_seed(torch.initial_seed())  # the default generator as a new process has it
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as at numpy's import
    # Python's random module reseeds itself in a forked child (os.register_at_fork)


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module *args`` in this process: its exit status."""
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as -m does
    sys.modules.pop(module, None)  # preloaded: -m runs it as __main__ only, its imports kept
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return _exit_status(done.code)
    except KeyboardInterrupt:  # as the interpreter ends: by SIGINT's default action
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit_status(code) -> int:
    """The status ``sys.exit(code)`` gives (None: 0; a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _finish(code: int) -> NoReturn:
    """End as the interpreter ends (non-daemon threads, ``atexit``, output), without freeing
    every module one by one."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(code)


# ----------------------------------------------------------------------------- the driver's side
class Forked:
    """A trial the server forked, as :func:`muoneq.suite.sweeps.launch.run_process` uses a
    ``Popen``: ``pid``, ``returncode`` (None when it ended after its server died: unknown),
    ``wait(timeout)``, ``killpg(signum)``."""

    def __init__(self, server: Server, number: int, argv: Sequence[str]) -> None:
        self.server, self.number, self.args = server, number, list(argv)
        self.pid: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None  #: why it was not forked
        self.lost = False  #: its server died while it ran: its exit status is unknown
        self.pidfd: int | None = None
        self.forked, self.ended = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    @property
    def how(self) -> str:
        return f"forked by the warm server (pid {self.server.pid})"

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def killpg(self, signum: int) -> None:
        """Signal the trial's process group: through the server, which knows whether it is
        reaped; after the server died, directly while the pidfd says the trial lives."""
        if self.ended.is_set():
            raise ProcessLookupError(self.pid)
        if not self.lost and self.server.send({"op": "signal", "id": self.number,
                                               "signum": signum}):
            return
        with self._lock:
            if self.pidfd is None or _ended(self.pidfd):
                raise ProcessLookupError(self.pid)
            os.killpg(self.pid, signum)

    def _end(self, returncode: int | None) -> None:
        with self._lock:
            self.returncode = returncode
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
            self.ended.set()


def _ended(pidfd: int, timeout: float = 0.0) -> bool:
    """Whether the process of ``pidfd`` has ended (a pidfd is readable then)."""
    return bool(select.select([pidfd], [], [], timeout)[0])


class Server:
    """One warm server, from the driver's side: started with :meth:`start`, asked to fork by
    :meth:`fork`; a thread reads its replies."""

    def __init__(self, preload_module: str, env: Mapping[str, str], log_path: Path) -> None:
        self.preload, self.env, self.log_path = preload_module, dict(env), Path(log_path)
        self.cwd = os.getcwd()
        self.pid: int | None = None
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.failure: str | None = None  #: why it is not (or no longer) usable
        self.dead = threading.Event()
        self.imported = ""  #: what its imports took (its ready message)
        self.announced = False  #: its readiness was logged
        self._closing = False
        self._trials: dict[int, Forked] = {}
        self._numbers = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (its imports go on in the background: :meth:`wait_ready`)."""
        self.started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out, theirs:
            out.write(f"=== {time.strftime('%F %T')} warm server for {self.cwd}\n".encode())
            out.flush()
            # a session of its own: the terminal's Ctrl-C reaches the driver, which stops the
            # trials; the server ends when the driver closes its end of the socket
            self._process = subprocess.Popen(
                [sys.executable, "-c", SERVER_MAIN, str(theirs.fileno())],
                env={**self.env, THREADS_ENV: "1"},
                cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(theirs.fileno(),))
        self.pid = self._process.pid
        self._sock = ours
        with contextlib.suppress(OSError):  # it ended at once: its reader finds out why
            _send(ours, {"preload": self.preload, "threads": self.env.get(THREADS_ENV)})
        threading.Thread(target=self._read, name="warm-server-reader", daemon=True).start()

    def wait_ready(self, stop: threading.Event, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the server has imported; :class:`Unavailable` when it cannot serve,
        :class:`Interrupted` when ``stop`` is set first."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if stop.is_set():
                raise Interrupted("the sweep was interrupted before the trial started")
            if self.dead.is_set():
                raise Unavailable(self.failure or "the warm server ended")
            if time.monotonic() > deadline:
                self.close()
                raise Unavailable(f"the warm server did not finish its imports in "
                                  f"{timeout:.0f} s")

    def send(self, message: dict, fds: Sequence[int] = ()) -> bool:
        """Send ``message``; False when the server is gone."""
        if self.dead.is_set() or self._sock is None:
            return False
        try:
            with self._lock:
                _send(self._sock, message, fds)
        except OSError:
            return False
        return True

    def fork(self, argv: Sequence[str], module: str, env: Mapping[str, str], log_fd: int,
             lock_fd: int) -> Forked:
        """Fork the trial ``argv`` (run as ``python -m module argv[3:]``); :class:`Unavailable`
        when the server cannot (the caller spawns it)."""
        with self._lock:
            trial = Forked(self, next(self._numbers), argv)
            self._trials[trial.number] = trial
        request = {"op": "run", "id": trial.number, "module": module, "args": list(argv[3:]),
                   "env": dict(env), "cwd": os.getcwd()}
        if not self.send(request, [log_fd, lock_fd]):
            self._forget(trial)
            raise Unavailable(self.failure or "the warm server ended")
        while not trial.forked.wait(0.2):
            if self.dead.is_set():  # it may have forked the trial: the lock will say
                raise Unavailable(self.failure or "the warm server ended")
        if trial.error is not None:
            self._forget(trial)
            raise Unavailable(trial.error)
        return trial

    def _forget(self, trial: Forked) -> None:
        with self._lock:
            self._trials.pop(trial.number, None)

    def _read(self) -> None:
        """Replies, until the server's end; then watch its orphaned trials."""
        sock = self._sock
        while True:
            try:
                message, fds = _receive(sock)
            except OSError:
                message, fds = None, []
            if message is None:
                break
            if "ready" in message:
                self.imported = (f"{message['modules']} modules imported, "
                                 f"{time.monotonic() - self.started:.1f} s after its start")
                self.ready.set()
            elif "error" in message and "id" not in message:
                self.failure = f"the warm server could not start: {message['error']}"
                break
            else:
                self._deliver(message, fds)
        self._lost()

    def _deliver(self, message: dict, fds: list[int]) -> None:
        with self._lock:
            trial = self._trials.get(message["id"])
        if trial is None:
            for fd in fds:
                os.close(fd)
            return
        if "pid" in message:
            trial.pid, trial.pidfd = message["pid"], fds[0] if fds else None
            trial.forked.set()
        elif "error" in message:
            trial.error = message["error"]
            trial.forked.set()
        else:
            self._forget(trial)
            trial._end(message["exit"])

    def _lost(self) -> None:
        """The server ended (or its socket broke): its trials run on as orphans, watched through
        their pidfds until they end (exit status unknown)."""
        status = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                # its socket closes as it exits: its status follows at once
                status = self._process.wait(timeout=5)
        if self.failure is None and self._closing:
            self.failure = "the warm server was closed"
        elif self.failure is None:
            self.failure = (f"the warm server (pid {self.pid}) ended"
                            + (f" with status {status}" if status is not None else ""))
        self.dead.set()
        with self._lock:
            orphans = list(self._trials.values())
            self._trials.clear()
        for trial in orphans:
            trial.lost = True
            trial.forked.set()
        watched = [t for t in orphans if t.pidfd is not None]
        for trial in orphans:
            if trial.pidfd is None:
                trial._end(None)  # never forked, or unknown: its lock says whether it lives
        while watched:
            ended = select.select([t.pidfd for t in watched], [], [])[0]
            for trial in [t for t in watched if t.pidfd in ended]:
                watched.remove(trial)
                trial._end(None)

    def close(self) -> None:
        """Close the socket: the server ends (its trials, if any, run on). A server still
        importing is killed (it holds no trial)."""
        self._closing = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        process = self._process
        if process is not None:
            try:
                process.wait(timeout=10 if self.ready.is_set() else 0.5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def describe(module: str | None, why: str) -> str:
    """How trials start (:func:`~muoneq.suite.sweeps.spec.warm_module`'s answer), in words."""
    if module is None:
        return f"each trial is spawned as its own command ({why})"
    return f"trials start warm: one server imports the runtime once and forks each trial ({why})"


class Launcher:
    """How one driver starts its trials: forked by a warm :class:`Server` (``launch.warm``,
    :func:`warm_module`), or spawned as their command; the choice and every fallback are
    logged, and each trial's log and ``trial.json`` say how it started."""

    def __init__(self, spec: SweepSpec, study_dir: Path, stop: threading.Event,
                 env_defaults: Mapping[str, str]) -> None:
        from muoneq.suite.sweeps.spec import warm_module

        self.spec, self.study_dir, self.stop = spec, Path(study_dir), stop
        self.env_defaults = dict(env_defaults)
        self.module, self.why = warm_module(spec)
        self.server: Server | None = None
        self.servers = 0  #: servers started so far
        self._lock = threading.Lock()

    def describe(self) -> str:
        """One line for the driver's log: how trials start, and why."""
        return describe(self.module, self.why)

    def open(self) -> None:
        """Start the server (its imports run while the driver plans), when trials run warm."""
        log.info("%s", self.describe())
        if self.module is not None:
            with self._lock:
                self._new_server()

    def close(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None

    def _new_server(self) -> Server:
        from muoneq.suite.sweeps.launch import trial_env

        env = trial_env(self.spec, (), self.env_defaults, self.study_dir)
        env.pop(self.spec.launch.device_env, None)  # each trial's own, read after the fork
        self.server = Server(RUNTIME_MODULE if self.module == RUNTIME_MODULE else self.module,
                             env, self.study_dir / SERVER_LOG)
        self.servers += 1
        self.server.start()
        return self.server

    def _server(self) -> Server | None:
        """The server to fork with, ready (a new one if the last died), or None: spawn."""
        with self._lock:
            server = self.server
            if self.module is None:
                return None
            if server is None or server.dead.is_set():
                why = server.failure if server is not None else "no server"
                if self.servers >= MAX_SERVERS:
                    self._give_up(f"{why}, and {self.servers} servers were started already")
                    return None
                log.warning("%s; its trials that still run go on and are waited for; starting "
                            "a new warm server", why)
                if server is not None:
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
            log.info("warm server ready (pid %s): %s", server.pid, server.imported)
        return server

    def _give_up(self, why: str) -> None:
        """Spawn every later trial (called under the lock)."""
        self.module = None
        self.why = f"warm trials stopped: {why}; see {self.study_dir / SERVER_LOG}"
        log.warning("%s", self.why)

    def _difference(self, server: Server, env: Mapping[str, str]) -> str | None:
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
        to be warm); :class:`Interrupted` when the sweep stopped first."""
        from muoneq.suite.sweeps.launch import spawn

        server = self._server()
        if server is not None:
            why = self._difference(server, env)
            if why is None:
                note = f"--- forked by the warm server (pid {server.pid})\n"
                out.write(note.encode())
                out.flush()
                try:
                    return server.fork(argv, self.module, env, out.fileno(), lock_fd)
                except Unavailable as err:
                    why = f"the warm server could not fork it: {err}"
            log.warning("trial %s is spawned: %s", shlex.join(argv[3:5]), why)
            out.write(f"--- spawned: {why}\n".encode())
            out.flush()
        return spawn(argv, env, out, lock_fd)


def main(argv: list[str]) -> int:
    """The server (:data:`SERVER_MAIN`): serve on the socket whose descriptor is ``argv[0]``."""
    return serve(socket.socket(fileno=int(argv[0])))

