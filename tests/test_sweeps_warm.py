"""Warm trials (``launch.warm``): forked by a server that imported once, with what a spawned
trial has: its own process, signals, lock, environment and CPU threads; a trial killed in it is
retried while the others finish; a server that dies is replaced, its running trial waited for;
and a result is the same, warm or spawned."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from muoneq.suite import code_version
from muoneq.suite.sweeps import Driver, SweepError, launch, load_sweep, warm
from muoneq.suite.sweeps.launch import warm_module
from muoneq.suite.sweeps.spec import DEFAULT_COMMAND, spec_from_dict
from tests.helpers.runtime import tiny_cifar10, tiny_language
from tests.helpers.sweeps import COMMAND, WARM_LAUNCH, load, options, scalars, write_sweep

REPO = Path(__file__).resolve().parents[1]
#: the objective program as the warm server preloads and forks it
OBJECTIVE_MODULE = "tests.helpers.sweep_objective_program"


@pytest.fixture(autouse=True)
def _from_the_checkout(monkeypatch):
    """The objective program runs as a module of the checkout (``-m tests.helpers…``)."""
    monkeypatch.chdir(REPO)


def wait_for(condition, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {limit_s:.0f} s for {what}"
        time.sleep(0.05)


def forked_by(run_dir: Path) -> list[int]:
    """The warm server of each attempt of a run, from its ``trial.log``."""
    text = (run_dir / launch.LOG_NAME).read_text()
    return [int(pid) for pid in re.findall(r"--- forked by the warm server \(pid (\d+)\)", text)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# ----------------------------------------------------------------------------- the choice
def test_launch_warm_is_a_checked_recorded_choice(tmp_path):
    spec = load_sweep(write_sweep(tmp_path / "a.yaml", launch={"command": DEFAULT_COMMAND}))
    assert spec.launch.warm == "auto"
    assert warm_module(spec) == ("muoneq", "launch.warm=auto")
    spec = load_sweep(write_sweep(tmp_path / "b.yaml", launch=WARM_LAUNCH))
    assert spec.launch.warm == "true"  # YAML's boolean, as the study records it
    assert warm_module(spec) == (OBJECTIVE_MODULE, "launch.warm=true")
    custom = load_sweep(write_sweep(tmp_path / "c.yaml"))  # a command run by its path
    module, why = warm_module(custom)
    assert module is None and why.startswith("launch.warm=auto forks only trials of the "
                                             "default launch.command")
    off = load_sweep(write_sweep(tmp_path / "d.yaml", launch={**WARM_LAUNCH, "warm": False}))
    assert warm_module(off) == (None, "launch.warm=false")
    with pytest.raises(SweepError) as err:
        load_sweep(write_sweep(tmp_path / "e.yaml", launch={"command": COMMAND, "warm": True}))
    assert str(err.value).endswith(
        "launch.warm=true forks trials of a command `{python} -m MODULE …`, and launch.command "
        f"is {COMMAND!r}; set launch.warm=auto or false")
    with pytest.raises(SweepError, match=r"launch.warm='sometimes' is invalid; allowed: auto, "
                                         r"true, false"):
        load_sweep(write_sweep(tmp_path / "f.yaml"), ["launch.warm=sometimes"])
    saved = yaml.safe_load((tmp_path / "b.yaml").read_text())
    assert spec_from_dict(saved).launch.warm == "true"


def test_auto_spawns_where_a_gpu_is_visible_and_true_forks_there(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 2)
    auto = load_sweep(write_sweep(tmp_path / "a.yaml", launch={"command": DEFAULT_COMMAND}))
    assert warm_module(auto) == (None, "launch.warm=auto spawns the trials of a machine with a "
                                       "GPU (2 visible), which last long enough that their "
                                       "imports hardly count; launch.warm=true forks them")
    forced = load_sweep(write_sweep(tmp_path / "b.yaml", launch={"command": DEFAULT_COMMAND,
                                                                 "warm": True}))
    assert warm_module(forced) == ("muoneq", "launch.warm=true")


def test_a_kernel_that_refuses_pidfds_is_found_before_warm_is_chosen(tmp_path, monkeypatch):
    """os.pidfd_open exists on every Linux build of Python ≥ 3.9; the kernel (< 5.3) or a
    sandbox may still refuse the call: asked once, the trials are spawned, saying why."""
    def refused(pid, flags=0):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    assert warm.supported() == ("this kernel refuses a pidfd (os.pidfd_open: Function not "
                                "implemented; warm trials need Linux ≥ 5.3)")
    spec = load_sweep(write_sweep(tmp_path / "a.yaml", launch=WARM_LAUNCH))
    assert warm_module(spec) == (None, f"launch.warm=true, but {warm.supported()}")


# ----------------------------------------------------------------------------- one fork
def test_a_forked_trial_has_its_own_process_environment_threads_and_lock(tmp_path):
    """torch sizes its CPU threads from OMP_NUM_THREADS when imported, which the server did
    with 1: a trial gets its own value, or without one what torch chooses in a new process."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    chosen = str(json.loads(subprocess.run(
        [sys.executable, "-c", warm.THREADS_PROBE], env=env, check=True, capture_output=True,
        text=True).stdout)[0])
    server = warm.Server(OBJECTIVE_MODULE, env, tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready(threading.Event())
        for name, threads in (("default", None), ("three", "3")):
            run_dir = tmp_path / name
            run_dir.mkdir()
            lock = os.open(run_dir / launch.LOCK_NAME, os.O_RDWR | os.O_CREAT)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as run_process takes it
            trial_env = env if threads is None else {**env, "OMP_NUM_THREADS": threads}
            with (run_dir / "trial.log").open("ab") as out:
                argv = ["python", "-m", OBJECTIVE_MODULE, "optimizer.lr=0.3", "block_first=true",
                        f"run.dir={run_dir}"]
                trial = server.fork(argv, OBJECTIVE_MODULE, trial_env, out.fileno(), lock)
            os.close(lock)  # the driver's copy: the trial's keeps the lock
            wait_for(lambda d=run_dir: (d / "blocked_once").exists(), "the trial to start")
            assert int((run_dir / "pid").read_text()) == trial.pid != server.pid
            assert os.getsid(trial.pid) == trial.pid  # a session of its own
            assert (run_dir / "threads").read_text() == (threads or "unset")
            assert (run_dir / "torch_threads").read_text() == (threads or chosen)
            assert launch.is_active(run_dir)
            trial.killpg(signal.SIGTERM)  # through the server
            assert trial.wait(timeout=60) == 143
            assert (run_dir / "checkpoint").read_text() == "SIGTERM"
            assert not launch.is_active(run_dir)
            with pytest.raises(ProcessLookupError):
                trial.killpg(signal.SIGTERM)  # reaped: never signalled again
    finally:
        server.close()
    assert gone(server.pid)


def test_a_server_that_cannot_start_leaves_the_trials_spawned_saying_why(tmp_path,
                                                                         monkeypatch, caplog):
    monkeypatch.setattr(warm, "SERVER_MAIN", "raise SystemExit(7)")
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], launch=WARM_LAUNCH))
    with caplog.at_level("INFO", logger="muoneq.suite.sweeps"):
        summary = Driver(spec, options(tmp_path, workers=2)).run()
    assert (summary.done, summary.exit_code) == (2, 0)
    why = "warm trials stopped: the warm server (pid "
    assert any(r.getMessage().startswith(why) and "with status 7" in r.getMessage()
               for r in caplog.records)
    for run_dir in (tmp_path / "runs" / "tiny" / "trials").glob("*/seed0"):
        record = json.loads((run_dir / launch.RECORD_NAME).read_text())
        assert record["process"] == "spawned" and record["pid"] == int(
            (run_dir / "pid").read_text())
        assert not forked_by(run_dir)


def test_the_server_imports_while_the_driver_checks_the_study(tmp_path, monkeypatch):
    """The server used to start once the driver had checked the study (every point's config
    composed and type-checked) and opened it: seconds a study of short trials paid before its
    first trial (docs/sweeps.md). It starts first; a check that fails leaves neither a server
    nor a file (its output is held until the study folder exists). A driver built after the
    runtime was imported (torch wrote its default compile cache into the environment) gives
    the server, and so every trial, the study's compile cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from muoneq.suite.sweeps import validate

    order, servers = [], []
    start, check = warm.Server.start, validate.check_trials

    def starting(server):
        order.append("server")
        servers.append(server)
        start(server)

    def checking(spec, study_dir):
        order.append("preflight")
        return check(spec, study_dir)

    monkeypatch.setattr(warm.Server, "start", starting)
    monkeypatch.setattr(validate, "check_trials", checking)
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], launch=WARM_LAUNCH))
    monkeypatch.setenv(launch.COMPILE_CACHE_ENV, "")  # restored after the test
    monkeypatch.delenv(launch.COMPILE_CACHE_ENV)
    cache_dir()  # what importing torch._dynamo does: torch writes its default
    assert os.environ[launch.COMPILE_CACHE_ENV]
    assert Driver(spec, options(tmp_path)).run().done == 2
    assert order[:2] == ["server", "preflight"]
    study = tmp_path / "runs" / "tiny"
    assert servers[0].env[launch.COMPILE_CACHE_ENV] == str(study.resolve() / "compile_cache")
    for run_dir in (p.run_dir(study, 0) for p in spec.points()):  # not spawned: env differs
        assert forked_by(run_dir) == [servers[0].pid], (run_dir / launch.LOG_NAME).read_text()
    log = (tmp_path / "runs" / "tiny" / warm.SERVER_LOG).read_text()
    assert log.startswith("=== ") and log.count("=== ") == 1

    def mistaken(spec, study_dir):
        raise SweepError("a mistake in the sweep")

    monkeypatch.setattr(validate, "check_trials", mistaken)
    other = load_sweep(write_sweep(tmp_path / "t.yaml", study="other", launch=WARM_LAUNCH))
    with pytest.raises(SweepError, match="a mistake in the sweep"):
        Driver(other, options(tmp_path))
    assert len(servers) == 2 and gone(servers[1].pid)
    assert not (tmp_path / "runs" / "other").exists()


def test_a_server_log_on_a_full_disk_drops_its_output_and_the_server_goes_on(tmp_path,
                                                                             caplog):
    """The driver reads the server's output from a pipe and appends it to its log: on a full
    disk it says so once and reads on; a server whose pipe filled up (64 KiB) would stop."""
    (tmp_path / "loud_preload.py").write_text(
        "import sys\nsys.stdout.write('x' * 300_000 + '\\n')\nsys.stdout.flush()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    server = warm.Server("loud_preload", env, Path("/dev/full"))
    server.start()
    try:
        server.keep_log()
        server.wait_ready(threading.Event(), timeout=120)
    finally:
        server.close()
    assert gone(server.pid)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "the rest of the warm server's output is dropped: /dev/full: [Errno 28] No space left "
        "on device"]


# ----------------------------------------------------------------------------- faults
def two_runs(tmp_path: Path, blocked: dict) -> Path:
    """A sweep of two runs, warm; the first point's first attempt waits to be killed."""
    return write_sweep(tmp_path / "s.yaml", seeds=[0], launch=WARM_LAUNCH, grid=[
        {"optimizer": ["muon_nes"], "optimizer.lr": [0.02], **blocked},
        {"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}])


def run_with(spec, tmp_path: Path, act) -> tuple:
    """Run the sweep (2 workers) while ``act`` runs in a thread; the summary and its error."""
    errors: list[BaseException] = []

    def guarded():
        try:
            act()
        except BaseException as err:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(err)

    helper = threading.Thread(target=guarded)
    helper.start()
    summary = Driver(spec, options(tmp_path, workers=2)).run()
    helper.join()
    if errors:
        raise errors[0]
    return summary


def starts(run_dir: Path) -> list[float]:
    return [float(x) for x in (run_dir / "starts.log").read_text().split()]


@pytest.mark.slow
def test_a_warm_trial_killed_by_sigkill_is_retried_and_the_other_finishes(tmp_path):
    spec = load_sweep(two_runs(tmp_path, {"block_first": ["true"]}))
    study = tmp_path / "runs" / "tiny"
    blocked, other = (p.run_dir(study, 0) for p in spec.points())

    def kill():
        wait_for(lambda: (blocked / "blocked_once").exists(), "the blocked trial")
        os.kill(int((blocked / "pid").read_text()), signal.SIGKILL)

    summary = run_with(spec, tmp_path, kill)
    assert (summary.done, summary.total, summary.exit_code) == (2, 2, 0)
    assert len(starts(blocked)) == 2 and len(starts(other)) == 1
    servers = forked_by(blocked) + forked_by(other)
    assert len(servers) == 3 and len(set(servers)) == 1  # one server served all three
    trials = load(tmp_path).trials
    assert [t.user_attrs["message"].splitlines()[0] for t in trials
            if t.state.name == "FAIL"] == ["exited with status -9"]


@pytest.mark.slow
def test_a_warm_server_killed_mid_sweep_is_replaced_and_its_running_trial_waited_for(tmp_path):
    spec = load_sweep(two_runs(tmp_path, {"block_first": ["true"]}))
    study = tmp_path / "runs" / "tiny"
    blocked, other = (p.run_dir(study, 0) for p in spec.points())
    stopped: list[float] = []

    def kill_the_server_then_the_trial():
        wait_for(lambda: (blocked / "blocked_once").exists(), "the blocked trial")
        (server,) = forked_by(blocked)
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: gone(server), "the server to end")
        pid = int((blocked / "pid").read_text())
        assert not gone(pid) and launch.is_active(blocked)  # the trial outlives its server
        stopped.append(time.time())
        os.kill(pid, signal.SIGTERM)

    summary = run_with(spec, tmp_path, kill_the_server_then_the_trial)
    assert (summary.done, summary.total, summary.exit_code) == (2, 2, 0)
    first, second = forked_by(blocked)
    assert first != second  # the retry ran on a new server
    assert (blocked / "checkpoint").read_text() == "SIGTERM"
    assert starts(blocked)[1] > stopped[0]  # not retried while the orphan lived
    assert len(starts(other)) == 1
    assert (study / warm.SERVER_LOG).read_text().count("=== ") == 2
    trials = load(tmp_path).trials
    failed = [t.user_attrs["message"] for t in trials if t.state.name == "FAIL"]
    assert len(failed) == 1 and failed[0].startswith(
        "ended; its exit status was lost with the warm server that forked it")
    assert gone(second)


# ----------------------------------------------------------------------------- the result
#: what a run measures of its machine and process, not what it computed
MEASURED = re.compile(r"time|wall|_per_s|seconds|load_|memory|run_dir")


def _computed(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in metrics.items() if not MEASURED.search(k)}


@pytest.mark.slow
def test_a_result_is_the_same_warm_or_spawned(tmp_path):
    """The same run (tiny LLaMA, muoneq train) forked warm and spawned: the same numbers."""

    base = {"experiment": "llama_tiny_shakespeare", "seeds": [0],
            "overrides": [*tiny_language(tmp_path), "trainer.max_steps=6",
                          "task.val_every_n_steps=2"],
            "grid": [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}],
            "objective": {"metric": "val/ppl"}}
    runs = {}
    for choice in ("true", "false"):
        spec = spec_from_dict({**base, "study": f"warm-{choice}", "launch": {"warm": choice}})
        assert Driver(spec, options(tmp_path)).run().done == 1
        run_dir = spec.points()[0].run_dir(tmp_path / "runs" / spec.study, 0)
        record = json.loads((run_dir / launch.RECORD_NAME).read_text())
        assert record["process"].startswith("forked by the warm server" if choice == "true"
                                            else "spawned")
        runs[choice] = run_dir
    warm_run, spawned = (_computed(runs[c]) for c in ("true", "false"))
    assert warm_run == spawned and warm_run["val/ppl"] > 0 and warm_run["global_step"] == 6
    curves = [{tag: values for tag, values in scalars(runs[c]).items()
               if not MEASURED.search(tag)} for c in ("true", "false")]
    assert curves[0] == curves[1] and "val/loss" in curves[0]


# ----------------------------------------------------------------------------- a fresh process
FRESH_VIEW = "tests.helpers.fresh_view"


def fork_one(server: warm.Server, run_dir: Path, module: str, env: dict, *args: str):
    """Fork ``python -m module *args run.dir=run_dir`` by ``server``, as run_process does: the
    trial's lock taken, its log open; the trial."""
    run_dir.mkdir(parents=True)
    lock = os.open(run_dir / launch.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with (run_dir / launch.LOG_NAME).open("ab") as out:
            return server.fork(["python", "-m", module, *args, f"run.dir={run_dir}"], module,
                               env, out.fileno(), lock)
    finally:
        os.close(lock)


@pytest.mark.slow
def test_a_forked_trial_sees_what_a_spawned_one_sees(tmp_path):
    """The same program (a package run with -m), spawned and forked twice: its package's
    __init__ ran once in its memory, it runs as __main__, its threads are the trial's (torch's
    and the BLAS library's, which read OMP_NUM_THREADS when loaded: 1 in the server), its random
    states are its own (torch's too: two warm trials never share one), and a file it never
    closed is flushed at its end. What differs, and is documented: the hash seed is the
    server's."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    views = {}
    done = subprocess.run([sys.executable, "-m", FRESH_VIEW, f"run.dir={tmp_path / 'spawned'}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    server = warm.Server(FRESH_VIEW, env, tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready(threading.Event())
        for name in ("forked", "forked_again"):
            trial = fork_one(server, tmp_path / name, FRESH_VIEW, env)
            assert trial.wait(timeout=300) == 0, (tmp_path / name / launch.LOG_NAME).read_text()
    finally:
        server.close()
    for name in ("spawned", "forked", "forked_again"):
        views[name] = json.loads((tmp_path / name / "view.json").read_text())
        assert (tmp_path / name / "held.txt").read_text() == "written, never flushed\n", name
    spawned, forked, again = views["spawned"], views["forked"], views["forked_again"]
    assert spawned["package_inits"] == forked["package_inits"] == 1
    assert spawned["main"] == forked["main"] == ["__main__", f"{FRESH_VIEW}.__main__",
                                                 "__main__.py", True]
    assert spawned["path0"] == forked["path0"] == str(REPO)
    assert spawned["threads"] == forked["threads"] == [2, 2]
    assert forked["torch_seed"] != again["torch_seed"], "two warm trials share torch's seed"
    for i, generator in enumerate(("torch", "numpy", "random")):
        assert forked["draws"][i] != again["draws"][i], f"{generator}: one random state"
    assert forked["hash"] == again["hash"]  # the documented difference: the server's hash seed


def test_a_request_too_large_for_the_socket_is_spawned_saying_so(tmp_path):
    """A trial's argv and environment go to the server as one message: one too large for it is
    refused before anything is sent (the server lives on), and said as it is."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    server = warm.Server(OBJECTIVE_MODULE, env, tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready(threading.Event())
        for size in (300_000, 2_000_000):  # the socket's own limit, then the server's reads
            with pytest.raises(warm.Unavailable) as err:
                fork_one(server, tmp_path / f"big{size}", OBJECTIVE_MODULE, env,
                         "optimizer.lr=0.3", f"note={'x' * size}")
            assert re.fullmatch(r"its request \([\d,]+ bytes: its arguments and environment\) "
                                r"is larger than one message to the warm server carries",
                                str(err.value)), str(err.value)
        trial = fork_one(server, tmp_path / "small", OBJECTIVE_MODULE, env, "optimizer.lr=0.3")
        assert trial.wait(timeout=60) == 0 and (tmp_path / "small" / "metrics.json").exists()
    finally:
        server.close()


@pytest.mark.slow
def test_the_runtime_server_imports_the_runtime_and_nothing_of_the_sweep(tmp_path):
    """What a trial forked by the runtime's server inherits: Lightning, muoneq train's modules;
    not Optuna, SQLAlchemy or the sweep's driver."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    server = warm.Server(warm.RUNTIME_MODULE, env, tmp_path / "server.log")
    server.start()
    try:
        server.wait_ready(threading.Event())
        run_dir = tmp_path / "trial"
        trial = fork_one(server, run_dir, "tests.helpers.modules_seen", env)
        assert trial.wait(timeout=120) == 0, (run_dir / launch.LOG_NAME).read_text()
    finally:
        server.close()
    # its end looks for open files among its objects, and says nothing (torch's deprecated
    # reduce_op warned when asked its class)
    assert "Warning" not in (run_dir / launch.LOG_NAME).read_text()
    seen = set(json.loads((run_dir / "modules.json").read_text()))
    assert {"lightning.pytorch", "muoneq.suite.runtime.run", "muoneq_tasks.language"} <= seen
    assert not {"optuna", "sqlalchemy", "muoneq.suite.sweeps.driver",
                "muoneq.suite.sweeps.spec"} & seen


def test_a_server_stopped_while_it_imports_is_given_up_in_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "STALL_S", 1.0)
    server = warm.Server(OBJECTIVE_MODULE, dict(os.environ), tmp_path / "server.log")
    server.start()
    os.kill(server.pid, signal.SIGSTOP)
    failed: list[BaseException] = []

    def wait():
        try:
            server.wait_ready(threading.Event())
        except warm.Unavailable as err:
            failed.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(timeout=60)
    try:
        assert not waiter.is_alive(), "the driver still waits for a stopped server"
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed: gone already
            os.kill(server.pid, signal.SIGCONT)
        server.close()
        waiter.join()
    assert str(failed[0]) == (f"the warm server (pid {server.pid}) was stopped (SIGSTOP, or a "
                              "debugger) for 1 s while it imported")
    assert gone(server.pid)


# ----------------------------------------------------------------------------- failure paths
def server_with(patch: str) -> str:
    """The server's program with ``patch`` run first (a fault injected into its process)."""
    return f"import os, sys; {patch}; " + warm.SERVER_MAIN.removeprefix("import sys; ")


#: the kernel refuses the pidfd of the child the server just forked
REFUSE_PIDFD = ("os.pidfd_open = lambda *a: (_ for _ in ()).throw(OSError(38, 'Function not "
                "implemented'))")
#: the server dies right after it forked a child, before it says so
DIE_AFTER_FORK = "os.pidfd_open = lambda *a: os._exit(9)"


def messages(tmp_path: Path) -> list[str]:
    return [t.user_attrs.get("message", "") for t in load(tmp_path).trials
            if t.state.name == "FAIL"]


def test_a_child_the_server_cannot_watch_is_killed_and_the_trial_spawned(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "SERVER_MAIN", server_with(REFUSE_PIDFD))
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], launch=WARM_LAUNCH))
    summary = Driver(spec, options(tmp_path)).run()
    assert (summary.done, summary.exit_code) == (2, 0) and messages(tmp_path) == []
    study = tmp_path / "runs" / "tiny"
    for run_dir in (p.run_dir(study, 0) for p in spec.points()):
        assert json.loads((run_dir / launch.RECORD_NAME).read_text())["process"] == "spawned"
        assert ("--- spawned: the warm server could not fork it: the server could not watch the "
                "process it forked (os.pidfd_open: [Errno 38] Function not implemented), which "
                "it killed\n") in (run_dir / launch.LOG_NAME).read_text()
        assert len(starts(run_dir)) == 1
    assert (study / warm.SERVER_LOG).read_text().count("=== ") == 1  # it lived on


@pytest.mark.slow
def test_a_trial_whose_server_ended_before_answering_is_never_started_twice(tmp_path,
                                                                           monkeypatch):
    """The server forked the trial and died before it said so: the trial runs, unknown to the
    driver, which must not start it again; it waits for the folder's lock, then reads
    metrics.json (as for an adopted run)."""
    monkeypatch.setattr(warm, "SERVER_MAIN", server_with(DIE_AFTER_FORK))
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], launch=WARM_LAUNCH,
                                  overrides=["steps=20", "sleep_s=1"]))
    summary = Driver(spec, options(tmp_path)).run()
    assert (summary.done, summary.exit_code) == (2, 0) and messages(tmp_path) == []
    for run_dir in (p.run_dir(tmp_path / "runs" / "tiny", 0) for p in spec.points()):
        assert len(starts(run_dir)) == 1, "started twice"
        assert re.search(r"--- the warm server \(pid \d+\) ended with status 9 after it was "
                         r"asked to fork this trial, before it said whether it did: it is not "
                         r"started again; its lock and metrics.json decide\n",
                         (run_dir / launch.LOG_NAME).read_text())


@pytest.mark.slow
def test_a_stopped_server_is_killed_in_bounded_time_and_the_sweep_goes_on(tmp_path, monkeypatch,
                                                                         caplog):
    monkeypatch.setattr(warm, "STALL_S", 3.0)
    monkeypatch.setattr(warm, "PING_S", 0.2)
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", launch=WARM_LAUNCH,
                                  overrides=["steps=20", "sleep_s=1"]))
    study = tmp_path / "runs" / "tiny"
    first = spec.points()[0].run_dir(study, 0)
    stopped: list[int] = []
    summaries = []

    def sweep():
        summaries.append(Driver(spec, options(tmp_path)).run())

    with caplog.at_level("WARNING", logger="muoneq.suite.sweeps"):
        driver = threading.Thread(target=sweep)
        driver.start()
        wait_for(lambda: (first / "pid").exists(), "the first trial")
        (server,) = forked_by(first)
        os.kill(server, signal.SIGSTOP)
        stopped.append(server)
        driver.join(timeout=120)
        if driver.is_alive():
            os.kill(server, signal.SIGCONT)
            driver.join()
            pytest.fail("the sweep waited for a stopped warm server")
    assert (summaries[0].done, summaries[0].total, summaries[0].exit_code) == (4, 4, 0)
    assert messages(tmp_path) == []
    said = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(rf"the warm server \(pid {server}\) is stopped \(SIGSTOP, or a "
                            r"debugger\): nothing from it for \d+ s; it was killed, the trials "
                            r"it forked run on", m) for m in said), said
    later = [pid for p in spec.points() for s in (0, 1) for pid in forked_by(p.run_dir(study, s))
             if p.run_dir(study, s) != first]
    assert later and server not in later
    assert gone(server)


# ----------------------------------------------------------------------------- the code it ran
def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["auto", "false"])
def test_every_trial_records_the_commit_of_the_code_it_ran(tmp_path, monkeypatch, choice):
    """A checkout changes (a commit, as a pull or an edit would) while its study runs: every
    trial, forked warm or spawned, records the commit whose code it ran (the version string
    it reports is that code's), and a warm trial the server it was forked from."""
    checkout = tmp_path / "checkout"
    for folder in ("muoneq", "conf"):
        shutil.copytree(REPO / folder, checkout / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    git(checkout, "init", "-q")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-qm", "before")
    before = git(checkout, "rev-parse", "HEAD")
    monkeypatch.chdir(checkout)  # the server and spawned trials import muoneq from here
    monkeypatch.delenv(code_version.COMMIT_ENV, raising=False)
    spec = spec_from_dict({
        "study": "commits", "experiment": "cifar10_resnet18", "seeds": [0],
        "overrides": [*tiny_cifar10(tmp_path), "trainer.max_steps=3"],
        "grid": [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.01, 0.02, 0.03]}],
        "objective": {"metric": "test/acc", "direction": "maximize"},
        "launch": {"warm": choice}})
    study = tmp_path / "runs" / "commits"

    def commit_while_the_first_trial_runs():
        wait_for(lambda: any(study.glob("trials/*/seed0/config.yaml")), "the first trial")
        init = checkout / "muoneq" / "__init__.py"
        init.write_text(init.read_text().replace('__version__ = "0.1.0"',
                                                 '__version__ = "0.1.0+after"'))
        git(checkout, "commit", "-qam", "after")

    helper = threading.Thread(target=commit_while_the_first_trial_runs)
    helper.start()
    assert Driver(spec, options(tmp_path)).run().done == 3
    helper.join()
    after = git(checkout, "rev-parse", "HEAD")
    ran = []
    for run_dir in (p.run_dir(study, 0) for p in spec.points()):
        provenance = yaml.safe_load((run_dir / "config.yaml").read_text())["provenance"]
        metrics = json.loads((run_dir / "metrics.json").read_text())
        code = (provenance["muoneq_version"], provenance["git_commit"])
        assert code in {("0.1.0", before), ("0.1.0+after", after)}, code
        assert provenance["git_dirty"] is False and metrics["git_commit"] == code[1]
        record = json.loads((run_dir / launch.RECORD_NAME).read_text())
        forked = provenance.get("forked_from")
        assert (forked is not None) == (choice == "auto")
        if forked is not None:
            assert (forked["git_commit"], forked["git_dirty"]) == (code[1], False)
            assert forked["pid"] == int(record["process"].split("pid ")[1].rstrip(")"))
        ran.append((record["started"], code[1], forked and forked["pid"]))
    ran.sort()
    assert ran[0][1] == before and ran[-1][1] == after  # the change fell within the study
    if choice == "auto":  # a server per version of the code
        assert len({(commit, pid) for _, commit, pid in ran}) == len({pid for *_, pid in ran})
