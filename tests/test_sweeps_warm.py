"""Warm trials (``launch.warm``): forked by a server that imported once, with what a spawned
trial has: its own process, signals, lock, environment and CPU threads; a trial killed in it is
retried while the others finish; a server that dies is replaced, its running trial waited for;
and a result is the same, warm or spawned."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from muoneq.suite.sweeps import Driver, SweepError, launch, load_sweep, warm
from muoneq.suite.sweeps.launch import warm_module
from muoneq.suite.sweeps.spec import DEFAULT_COMMAND, spec_from_dict
from tests.helpers.runtime import tiny_language
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
