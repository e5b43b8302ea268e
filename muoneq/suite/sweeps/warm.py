"""Warm trials: a server that imports the runtime once and forks one process per trial.

A trial of the default launch command (``{python} -m muoneq train …``) pays seconds of imports
(torch, Lightning, the tasks) before its first step, and about a second of interpreter exit
after it. With ``launch.warm`` (:func:`muoneq.suite.sweeps.launch.warm_module`), a driver starts
one *server*, a process of its own that imports them once; for each trial it forks a child that
runs the trial's module as ``python -m`` would (:func:`runpy.run_module`, the trial's argv as
``sys.argv``) with the trial's environment, working folder, output (its ``trial.log``, as stdout
and stderr) and lock (``.trial.lock``), the two files sent over a Unix socket (``SCM_RIGHTS``).
This module holds the server, its children and the driver's side of the socket
(:class:`Server`); when a trial is forked and when it is spawned is
:class:`muoneq.suite.sweeps.launch.Launcher`'s choice.

multiprocessing's ``forkserver`` (with ``set_forkserver_preload``) forks the same way but runs
functions of its caller, not programs with their own argv, environment, output and lock, hence
the few lines here. The server imports this module, which imports only the standard library and
:mod:`muoneq` (the library: torch), then what :func:`preload` names: nothing of the sweep, which
a trial would inherit. What a spawned trial has, a forked one keeps:

* **a process of its own**: a crash or a kill ends it alone; it leads a session of its own
  (``setsid``), so the driver signals its process group as before (through the server, which
  never signals a child it has already reaped: a pid is not reused while it is a zombie);
* **the lock**: the driver's own open file description of ``.trial.lock``, so the kernel holds
  the lock while the trial lives, whatever dies first (driver, server), and a later driver
  adopts the live trial as before (:func:`muoneq.suite.sweeps.launch.is_active`);
* **the code it records**: the server takes the checkout's commit and dirty state before it
  imports (:mod:`muoneq.suite.code_version`) and each child records them with the server it was
  forked from; the driver forks only while the checkout is still at that version;
* **its start state**: the environment is the trial's (``os.environ``: children it spawns and
  every later read see it); torch's CPU threads and the BLAS library's, which each sizes when it
  is loaded (from ``OMP_NUM_THREADS``: 1 in the server), are set to the trial's value, or to what
  a new process chooses without one (asked once of a new process); the random states are a new
  process's (torch's default generator, Python's and NumPy's reseeded from the OS); the module
  the trial runs is run anew as ``__main__``, a package it lies in is the server's (imported
  once, as ``-m`` imports it once);
* **its end**: as the interpreter ends (non-daemon threads joined, ``atexit`` handlers run,
  every open file flushed), without freeing every module one by one (``os._exit``: a second per
  trial).

What differs: the hash seed of ``str`` and ``bytes`` (``PYTHONHASHSEED``) is the server's, shared
by the trials it forks (it is fixed when an interpreter starts); ``sys.modules`` holds what the
server imported.

If the server dies, its running trials live on, each still holding its lock: the driver watches
them through a pidfd (sent by the server at the fork; ``os.pidfd_open``, Linux ≥ 5.3), their
exit status is unknown and their ``metrics.json`` decides, as for an adopted run. A server that
stops answering (stopped by SIGSTOP or a debugger, hung) for :data:`STALL_S` is killed and dealt
with the same way. A trial the server was asked to fork but never answered for is never started
again by the driver: whether it runs is unknown, and its lock and ``metrics.json`` decide, as for
an adopted run (:class:`Unknown`).

Threads: a process forked while another of its threads runs gets a copy of the calling thread
only, and whatever the others held stays held in it (an OpenMP pool forked after it worked
hangs the child's next parallel region). torch's import starts a second thread when it may use
more than one CPU thread, so the server imports with ``OMP_NUM_THREADS=1``, checks that it runs
one thread before every fork, and each child sizes its own pools.

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
import dataclasses
import datetime
import errno
import gc
import importlib
import importlib.util
import io
import json
import logging
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, NoReturn

from muoneq.suite import code_version

log = logging.getLogger("muoneq.suite.sweeps")

#: the module whose command the server preloads the runtime for (``{python} -m muoneq …``)
RUNTIME_MODULE = "muoneq"
#: servers that ended on their own one driver replaces; then trials are spawned
MAX_FAILED_SERVERS = 3
#: seconds a server may take to import before trials are spawned instead
READY_TIMEOUT_S = 600.0
#: seconds a server may leave the driver without an answer (stopped, hung) before it is killed
STALL_S = 30.0
#: how often the driver asks a ready server whether it answers, in seconds
PING_S = 5.0
#: the server's output (its import warnings, why it stopped), appended, under the study folder
SERVER_LOG = "warm_server.log"
#: the largest message on the socket (a trial's argv and environment)
MAX_MESSAGE = 1 << 20
#: a trial's CPU threads: torch and the BLAS library read it when loaded (the server imports
#: with 1)
THREADS_ENV = "OMP_NUM_THREADS"
#: variables the BLAS library reads before ``OMP_NUM_THREADS`` (the server's are the trial's)
BLAS_THREADS_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS")
#: what torch and the BLAS library choose without ``OMP_NUM_THREADS``, asked of a new process
THREADS_PROBE = ("import json, numpy, threadpoolctl, torch; "
                 "blas = [i['num_threads'] for i in threadpoolctl.threadpool_info() "
                 "if i['user_api'] == 'blas']; "
                 "print(json.dumps([torch.get_num_threads(), max(blas, default=None)]))")
#: the server's program (``-c``: ``-m`` would run a second copy of this module)
SERVER_MAIN = "import sys; from muoneq.suite.sweeps.warm import main; main(sys.argv[1:])"


class Unavailable(RuntimeError):
    """Why a trial cannot be forked warm (the message is logged; it is spawned)."""


class Unknown(RuntimeError):
    """The server was asked to fork a trial and ended before it said whether it did: the trial
    may run. It must not be started again: its lock and ``metrics.json`` decide."""


class Interrupted(RuntimeError):
    """The sweep was interrupted while a trial waited for its server: it never started."""


def supported() -> str | None:
    """Why this platform cannot run warm trials, or None when it can (the kernel is asked for a
    pidfd of this process: ``os.pidfd_open`` exists from Python 3.9 on, the call from Linux
    5.3 on, and a sandbox may refuse it)."""
    missing = [name for name, owner in (("fork", os), ("pidfd_open", os), ("setsid", os),
                                        ("send_fds", socket)) if not hasattr(owner, name)]
    if missing:
        return f"this platform lacks {', '.join(missing)} (warm trials need Linux ≥ 5.3)"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as err:
        return (f"this kernel refuses a pidfd (os.pidfd_open: {err.strerror or err}; warm trials "
                "need Linux ≥ 5.3)")
    return None


# ----------------------------------------------------------------------------- the socket
class TooLarge(Unavailable):
    """A request larger than one message on the socket carries."""


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """Send ``message`` as one packet; :class:`TooLarge` when it does not fit in one (nothing
    was sent)."""
    data = json.dumps(message).encode()
    try:
        if len(data) > MAX_MESSAGE:  # what the other end reads at once
            raise OSError(errno.EMSGSIZE, os.strerror(errno.EMSGSIZE))
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendall(data)
    except OSError as err:
        if err.errno != errno.EMSGSIZE:  # also the socket's own limit, below MAX_MESSAGE
            raise
        raise TooLarge(f"its request ({len(data):,} bytes: its arguments and environment) is "
                       "larger than one message to the warm server carries") from None


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the file descriptors it carried; ``(None, [])`` at the end."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    return (json.loads(data) if data else None), fds


# ----------------------------------------------------------------------------- the server
def preload(module: str) -> None:
    """Import what a trial of ``python -m module`` imports before its work: for ``muoneq``
    the runtime as ``muoneq train`` imports it (Lightning without torchmetrics' optional
    packages when every installed task allows it: :mod:`muoneq.suite.runtime.lean_imports`, so
    that a forked trial has the metrics a spawned one has) and the tasks' packages; else the
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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def serve(sock: socket.socket) -> int:
    """The server's loop (module docstring): take the code's version, preload, say ready, then
    fork trials, reap them, relay signals and answer pings until the driver closes its end
    (the trials then run on)."""
    hello, _ = _receive(sock)
    if hello is None:
        return 0
    version, started = code_version.taken(), _now()  # before the imports: what trials run
    # the threads a new process would choose, read only for trials that do not set theirs:
    # none where the server's environment does (a forked trial's is the server's)
    probe = None
    if _thread_count(hello["threads"]) is None:
        env = {k: v for k, v in os.environ.items() if k != THREADS_ENV}
        probe = subprocess.Popen([sys.executable, "-c", THREADS_PROBE], env=env,
                                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        preload(hello["preload"])
        chosen, blas = (None, None) if probe is None else json.loads(
            probe.communicate()[0].splitlines()[-1])
        _forkable()
    except BaseException as err:
        traceback.print_exc()
        _send(sock, {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"})
        return 1
    _send(sock, {"ready": os.getpid(), "modules": len(sys.modules),
                 "version": dataclasses.asdict(version)})
    defaults = {"pid": os.getpid(), "started": started, "default_threads": chosen,
                "default_blas_threads": blas}
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
                if message["op"] == "ping":
                    _reply(sock, {"pong": True})
                elif message["op"] == "signal":
                    _signal(children, message)
                else:
                    _fork(sock, selector, children, {**message, "server": defaults}, fds)


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
    """Fork the trial ``message`` describes, with ``fds`` = (its log, its lock); a child the
    server cannot watch (no pidfd) is killed and reaped before the driver is told."""
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
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:  # unwatched, its end could not be told: it must not run
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _reply(sock, {"id": message["id"], "error": f"the server could not watch the process "
                                                    f"it forked (os.pidfd_open: {err}), which "
                                                    "it killed"})
        return
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
        server = message["server"]
        code_version.mark_forked(server["pid"], server["started"])
        _fresh_state(message["env"], server)
        code = _run_module(message["module"], message["args"])
    except BaseException:  # noqa: BLE001 (the child must end here, never in the server's loop)
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    _finish(code)


def _thread_count(value: str | None) -> int | None:
    """``OMP_NUM_THREADS`` as torch takes it (a positive number), or None."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def _fresh_state(env: Mapping[str, str], server: Mapping) -> None:
    """What a new process would start with: torch's CPU threads and the BLAS library's
    (``OMP_NUM_THREADS``, read when each was loaded in the server, where it was 1; else what a
    new process chooses), new random states."""
    threads = _thread_count(env.get(THREADS_ENV))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads or server["default_threads"])
        torch.default_generator.seed()  # from the OS's entropy, as at torch's import
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as at numpy's import
        blas = threads or server["default_blas_threads"]
        if blas and not any(name in env for name in BLAS_THREADS_ENV):
            import threadpoolctl

            threadpoolctl.threadpool_limits(blas, user_api="blas")
    # Python's random module reseeds itself in a forked child (os.register_at_fork)


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module *args`` in this process: its exit status. The module run as
    ``__main__`` (a package's ``__main__``) runs anew; the packages it lies in are the
    server's."""
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as -m does
    spec = importlib.util.find_spec(module)
    main = f"{module}.__main__" if spec and spec.submodule_search_locations is not None else module
    sys.modules.pop(main, None)  # -m runs it as __main__ only
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


#: the files whose writes wait in a buffer (their C types: ``isinstance`` against the ABC
#: ``io.IOBase`` takes ten times longer over a trial's objects)
BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def _flush_files() -> None:
    """Flush every open buffered file, text wrappers before the buffers under them, as the
    interpreter does when it frees them at its end: a module may hold a file it never closed."""
    with warnings.catch_warnings():  # isinstance reads __class__, which some objects warn on
        warnings.simplefilter("ignore")  # (torch.distributed.reduce_op: a FutureWarning)
        files = [f for f in gc.get_objects() if isinstance(f, BUFFERED)]
    for file in sorted(files, key=lambda f: not isinstance(f, io.TextIOWrapper)):
        with contextlib.suppress(Exception):
            if not file.closed:
                file.flush()


def _finish(code: int) -> NoReturn:
    """End as the interpreter ends (non-daemon threads, ``atexit``, open files flushed),
    without freeing every module one by one."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        _flush()
        _flush_files()
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


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP) or held by a debugger."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except (OSError, IndexError):
        return False


class Server:
    """One warm server, from the driver's side: started with :meth:`start`, asked to fork by
    :meth:`fork`; a thread reads its replies, another asks every :data:`PING_S` whether it
    answers and kills it after :data:`STALL_S` without an answer."""

    def __init__(self, preload_module: str, env: Mapping[str, str], log_path: Path) -> None:
        self.preload, self.env, self.log_path = preload_module, dict(env), Path(log_path)
        self.cwd = os.getcwd()
        self.pid: int | None = None
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.failure: str | None = None  #: why it is not (or no longer) usable
        self.dead = threading.Event()
        self.modules = 0  #: the modules it imported (its ready message)
        self.import_s = 0.0  #: seconds from its start to its ready message
        #: the version of the code it imported (taken before its imports)
        self.version: code_version.CodeVersion | None = None
        self.announced = False  #: its readiness was logged
        self._heard = time.monotonic()  #: when it last said something
        self._closing = False
        self._trials: dict[int, Forked] = {}
        self._numbers = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        #: its output: held until :meth:`keep_log` opens its log, then appended there
        self._held = bytearray()
        self._log: IO[bytes] | None = None
        self._copier: threading.Thread | None = None
        self._output_lock = threading.Lock()

    @property
    def imported(self) -> str:
        return f"{self.modules} modules imported, {self.import_s:.1f} s after its start"

    def running(self) -> int:
        """How many of its trials have not ended."""
        with self._lock:
            return len(self._trials)

    def start(self) -> None:
        """Start the server (its imports go on in the background: :meth:`wait_ready`). Its
        output (import warnings, why it stopped) is held until :meth:`keep_log`: a driver
        starts it before it checks the study, and a study that fails the check leaves no
        file."""
        self.started = time.monotonic()
        self._held += f"=== {time.strftime('%F %T')} warm server for {self.cwd}\n".encode()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # a session of its own: the terminal's Ctrl-C reaches the driver, which stops the
            # trials; the server ends when the driver closes its end of the socket
            self._process = subprocess.Popen(
                [sys.executable, "-c", SERVER_MAIN, str(theirs.fileno())],
                env={**self.env, THREADS_ENV: "1"}, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(theirs.fileno(),))
        self.pid = self._process.pid
        self._sock = ours
        self._copier = threading.Thread(target=self._copy_output, name="warm-server-output",
                                        daemon=True)
        self._copier.start()
        with contextlib.suppress(OSError):  # it ended at once: its reader finds out why
            _send(ours, {"preload": self.preload, "threads": self.env.get(THREADS_ENV)})
        threading.Thread(target=self._read, name="warm-server-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="warm-server-watch", daemon=True).start()

    def keep_log(self) -> None:
        """Append the server's output, so far and from now on, to its log file (made now)."""
        with self._output_lock:
            if self._log is None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = self.log_path.open("ab")
                self._write(bytes(self._held))
                self._held.clear()

    def _copy_output(self) -> None:
        """Hold or append the server's output until it ends (its pipe's end)."""
        pipe = self._process.stdout
        while chunk := pipe.read1(1 << 16):
            with self._output_lock:
                if self._log is None:
                    self._held += chunk
                else:
                    self._write(chunk)
        pipe.close()

    def _write(self, data: bytes) -> None:
        """Append ``data`` to the log (under the output lock). On a full disk the rest of the
        output is dropped, said once: the pipe is still read to its end, as a server whose pipe
        is full would stop."""
        try:
            self._log.write(data)
            self._log.flush()
        except OSError as err:
            log.warning("the rest of the warm server's output is dropped: %s: %s",
                        self.log_path, err)
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = open(os.devnull, "wb")  # closed by close()

    def wait_ready(self, stop: threading.Event, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the server has imported; :class:`Unavailable` when it cannot serve (it
        ended, took longer than ``timeout``, or was stopped for :data:`STALL_S`),
        :class:`Interrupted` when ``stop`` is set first."""
        deadline = time.monotonic() + timeout
        stopped_since = None
        while not self.ready.wait(0.2):
            if stop.is_set():
                raise Interrupted("the sweep was interrupted before the trial started")
            if self.dead.is_set():
                raise Unavailable(self.failure or "the warm server ended")
            now = time.monotonic()
            stopped_since = (stopped_since or now) if _stopped(self.pid) else None
            if stopped_since is not None and now - stopped_since > STALL_S:
                self.failure = (f"the warm server (pid {self.pid}) was stopped (SIGSTOP, or a "
                                f"debugger) for {STALL_S:.0f} s while it imported")
                self.close()
                raise Unavailable(self.failure)
            if now > deadline:
                self.close()
                raise Unavailable(f"the warm server did not finish its imports in "
                                  f"{timeout:.0f} s")

    def send(self, message: dict, fds: Sequence[int] = ()) -> bool:
        """Send ``message``; False when the server is gone (:class:`TooLarge`: never sent)."""
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
        """Fork the trial ``argv`` (run as ``python -m module argv[3:]``). :class:`Unavailable`
        when the server did not fork it (the caller may spawn it); :class:`Unknown` when the
        server ended after it was asked, before it said (the trial must not be started again:
        module docstring)."""
        with self._lock:
            trial = Forked(self, next(self._numbers), argv)
            self._trials[trial.number] = trial
        request = {"op": "run", "id": trial.number, "module": module, "args": list(argv[3:]),
                   "env": dict(env), "cwd": os.getcwd()}
        try:
            sent = self.send(request, [log_fd, lock_fd])
        except TooLarge:
            self._forget(trial)
            raise
        if not sent:
            self._forget(trial)
            raise Unavailable(self.failure or "the warm server ended")
        trial.forked.wait()  # an answer, or the server's end (bounded: STALL_S)
        if trial.error is not None:
            self._forget(trial)
            raise Unavailable(trial.error)
        if trial.pid is None:
            raise Unknown(f"{self.failure or 'the warm server ended'} after it was asked to "
                          "fork this trial, before it said whether it did")
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
            self._heard = time.monotonic()
            if "ready" in message:
                self.modules, self.import_s = message["modules"], self._heard - self.started
                self.version = code_version.CodeVersion(**message["version"])
                self.ready.set()
            elif "error" in message and "id" not in message:
                self.failure = f"the warm server could not start: {message['error']}"
                break
            elif "id" in message:
                self._deliver(message, fds)
        self._lost()

    def _watch(self) -> None:
        """Ask the ready server every :data:`PING_S` whether it answers; kill one that said
        nothing for :data:`STALL_S` (module docstring)."""
        while not self.dead.wait(PING_S):
            if not self.ready.is_set() or self._closing:
                continue  # importing: wait_ready bounds it
            silent = time.monotonic() - self._heard
            if silent > STALL_S:
                state = "is stopped (SIGSTOP, or a debugger)" if _stopped(self.pid) else (
                    "does not answer")
                self.failure = (f"the warm server (pid {self.pid}) {state}: nothing from it for "
                                f"{silent:.0f} s; it was killed, the trials it forked run on")
                log.warning("%s", self.failure)
                with contextlib.suppress(ProcessLookupError):
                    self._process.kill()
                return
            self.send({"op": "ping"})

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
        with self._lock:
            self.dead.set()
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
        importing, or stopped, is killed (it holds no trial, or answers nothing)."""
        self._closing = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        process = self._process
        if process is not None:
            try:
                process.wait(timeout=10 if self.ready.is_set() and not _stopped(process.pid)
                             else 0)
            except subprocess.TimeoutExpired:
                # its group: while it imports, its probe too (the threads a new process
                # chooses), which holds its output open; each trial leads a group of its own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._copier is not None:
            self._copier.join(timeout=5)  # the rest of its output, to its pipe's end
        with self._output_lock:
            if self._log is not None:
                self._log.close()
                self._log = None


def main(argv: list[str]) -> NoReturn:
    """The server (:data:`SERVER_MAIN`): serve on the socket whose descriptor is ``argv[0]``,
    then end as a trial ends (:func:`_finish`: without freeing every module it imported one by
    one, a second or more the driver would wait for at its end)."""
    _finish(serve(socket.socket(fileno=int(argv[0]))))
