"""The sweep driver on real trial processes (tests/test_sweeps_trial_program.py).

Covers: the sweep-file schema and its errors; a grid study (complete, retried failure, nothing
repeated on re-run); duplicates skipped; TPE; pruning by global step; SIGKILL of the driver
mid-study and resume; two driver processes sharing a study on the journal file and on a real
PostgreSQL server started by the test.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

import muoneq
from muoneq.suite.sweeps import Driver, SweepError, load_sweep
from muoneq.suite.sweeps.validate import check_trials
from tests.helpers.ports import free_port
from tests.helpers.sweeps import COMMAND, REPO, WARM_LAUNCH, load, options, write_sweep

#: the driver's bookkeeping is tested on trials whose objective is a known function
#: (helpers.sweeps.COMMAND); pruning needs a learning curve: a real optimization (this program)
PROGRAM = Path(__file__).with_name("test_sweeps_trial_program.py")
TRAINING = f"{{python}} {PROGRAM} {{overrides}} seed={{seed}} run.dir={{run_dir}}"


def completed_by_key(study: optuna.Study) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        out.setdefault(t.user_attrs["run_key"], []).append(t)
    return out


def assert_each_run_once(study: optuna.Study, study_dir: Path, expected: int) -> None:
    """One COMPLETE trial per run, its value = metrics.json, each folder executed once."""
    done = completed_by_key(study)
    assert len(done) == expected and all(len(v) == 1 for v in done.values()), done
    for (t,) in done.values():
        (rel,) = t.user_attrs["run_dirs"]
        run_dir = study_dir / rel
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert t.value == metrics["val_loss"] == t.user_attrs["metrics"]["val_loss"]
        starts = (run_dir / "starts.log").read_text().splitlines()
        assert len(starts) == 1 + (run_dir / "failed_once").exists(), (run_dir, starts)


# ------------------------------------------------------------------------------------ schema
def test_points_are_the_union_of_blocks_with_seeds_apart(tmp_path):
    path = write_sweep(tmp_path / "s.yaml", grid=[
        {"optimizer": ["sgd"], "optimizer.lr": [0.1, 0.05]},
        {"optimizer": ["muoneq_nes"], "optimizer.mode": ["R", "C"], "optimizer.lr": [5e-2]},
        {"optimizer": ["sgd"], "optimizer.lr": [0.05]},  # repeats a point of block 0
    ])
    spec = load_sweep(path, ["seeds=[3,4,5]"])
    keys = [p.key for p in spec.points()]
    assert keys == [
        "optimizer=sgd optimizer.lr=0.1",
        "optimizer=sgd optimizer.lr=0.05",
        "optimizer=muoneq_nes optimizer.lr=0.05 optimizer.mode=R",
        "optimizer=muoneq_nes optimizer.lr=0.05 optimizer.mode=C",
    ]  # axes in order of first appearance, whatever the block's order
    assert spec.axes() == ["optimizer", "optimizer.lr", "optimizer.mode"]
    assert spec.seeds == [3, 4, 5]
    point = spec.points()[2]
    assert point.overrides() == ["optimizer=muoneq_nes", "optimizer.lr=0.05", "optimizer.mode=R"]
    assert "/" not in point.slug() and " " not in point.slug()


@pytest.mark.parametrize("fields, words", [
    ({"gird": []}, ["gird", "grid"]),
    ({"objective": {"metric": "x", "direction": "up"}}, ["objective.direction", "maximize"]),
    ({"grid": [{"seed": [0, 1]}]}, ["seeds are their own axis"]),
    ({"grid": [{"optimizer.lr": []}]}, ["grid[0].optimizer.lr", "non-empty"]),
    ({"launch": {"command": "{python} -m x {overrides} run.dir={run_dir} {gpu}"}},
     ["unknown placeholder {gpu}", "devices"]),
    ({"launch": {"command": "{python} x --o={overrides} {run_dir}"}}, ["word of its own"]),
    ({"search": {"params": {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 1e-1}}}},
     ["exactly one of 'grid'"]),
    ({"report": {"heatmaps": [{"x": "optimizer.lr", "y": "optimizer.momentum"}]}},
     ["report.heatmaps.y='optimizer.momentum' is not a search axis"]),
    ({"grid": [], "search": {"params": {"optimizer": {"choices": ["adamw", "muon"]}}}},
     ["search.params.optimizer (type float)", "add search.params.optimizer.type=categorical"]),
    ({"grid": [], "search": {"params": {"optimizer.ns_steps": {
        "type": "int", "low": 2, "high": 5.5}}}}, ["(type int) needs integer low and high"]),
    ({"seeds": [0, 0]}, ["without repeats"]),
    ({"seeds": [0, -1]}, ["seeds[1]=-1", "[0, 4294967295]"]),
    ({"seeds": [2**32]}, ["seeds[0]=4294967296", "numpy's range"]),
])
def test_sweep_file_errors_name_the_field(tmp_path, fields, words):
    path = write_sweep(tmp_path / "s.yaml", **fields)
    with pytest.raises(SweepError) as err:
        load_sweep(path)
    for word in words:
        assert word in str(err.value)


#: paper artifact → (runs, objective metric)
SWEEP_FILES = {
    "ablation-cifar10": (99, "test/acc"),
    "ablation-gpt2": (96, "val/ppl"),
    "heatmap-gpt2": (64, "val/ppl"),
    "ksweep-gpt2": (12, "val/ppl"),
    "lrsweep-llama130m": (42, "val/ppl"),
    "lrsweep-llama350m": (36, "val/ppl"),
    "table-llama": (24, "best_val_ppl"),
}


@pytest.mark.parametrize("name", sorted(SWEEP_FILES))
def test_paper_sweep_files_have_their_paper_size(name):
    """Each sweep file has its paper size and objective; that every point composes as a
    ``muoneq train`` config is checked through ``make <target> ARGS=--dry-run``
    (tests/test_documented_commands.py)."""
    spec = load_sweep(REPO / "sweeps" / f"{name}.yaml")
    runs, metric = SWEEP_FILES[name]
    assert spec.study == name
    assert len(spec.points()) * len(spec.seeds) == runs
    assert spec.objective.metric == metric
    assert spec.report.tables or spec.report.heatmaps or spec.report.lines
    assert all(p.as_dict()["optimizer"] in muoneq.OPTIMIZERS for p in spec.points())
    # every study that chooses a learning rate brackets it (the K sweep holds the paper's)
    assert name == "ksweep-gpt2" or "optimizer.lr" in spec.bracket.axes


# ------------------------------------------------------------------------------- grid study
@pytest.mark.slow
def test_grid_study_completes_retries_and_resumes_without_repeats(tmp_path):
    grid = [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]},
            {"optimizer": ["adamw"], "optimizer.lr": [0.01], "fail_first": [True]},
            {"optimizer": ["sgd"], "optimizer.lr": [0.01], "config_error": [True]}]
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", grid=grid, seeds=[0]))
    summary = Driver(spec, options(tmp_path, workers=2)).run()
    bad = "optimizer=sgd optimizer.lr=0.01 config_error=true | seed=0"
    assert (summary.total, summary.done, summary.exhausted, summary.exit_code) == (
        3, 2, [bad], 1)
    study_dir = tmp_path / "runs" / "tiny"
    study = load(tmp_path)
    assert_each_run_once(study, study_dir, expected=2)
    failed = {t.user_attrs["outcome"]: t for t in study.get_trials(states=(TrialState.FAIL,))}
    assert sorted(failed) == ["config_error", "failed"]
    assert "exited with status 3" in failed["failed"].user_attrs["message"]
    assert "optimizer=adamw" in failed["failed"].user_attrs["run_key"]
    # exit status 2 (a config error) is failed at once: retrying cannot fix it
    assert "exited with status 2" in failed["config_error"].user_attrs["message"]
    (bad_dir,) = study_dir.glob("trials/optimizer=sgd*/seed0")
    assert (bad_dir / "starts.log").read_text().count("\n") == 1  # max_retries=1 unused
    # Re-running the study launches nothing finished and adds no trial for it; the run that
    # failed with a config error gets one attempt per re-run (the user may have fixed it).
    n_trials = len(study.get_trials())
    again = Driver(spec, options(tmp_path, workers=2)).run()
    assert again.done == 2 and again.exhausted == [bad]
    assert len(load(tmp_path).get_trials()) == n_trials + 1
    assert (bad_dir / "starts.log").read_text().count("\n") == 2
    assert_each_run_once(load(tmp_path), study_dir, expected=2)


@pytest.mark.slow
def test_duplicate_points_are_skipped(tmp_path):
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], grid=[
        {"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}]))
    driver = Driver(spec, options(tmp_path, workers=2))
    key = f"{spec.points()[0].key} | seed=0"
    for _ in range(3):  # what racing drivers produce: the same run claimed thrice
        driver.study.enqueue_trial({}, user_attrs={"run_key": key})
    assert driver.run().done == 1
    study = load(tmp_path)
    outcomes = sorted(t.user_attrs.get("outcome") for t in study.get_trials())
    assert outcomes == ["complete", "skipped", "skipped"]
    assert_each_run_once(study, tmp_path / "runs" / "tiny", expected=1)


@pytest.mark.slow
def test_open_search_uses_tpe_and_stops_on_the_budget(tmp_path):
    search = {"params": {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 5e-2,
                                          "log": True}},
              "n_trials": 2, "n_startup_trials": 1, "sampler_seed": 0}
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", grid=[], search=search, seeds=[0],
                                  overrides=["steps=20", "optimizer=muoneq_nes"]))
    driver = Driver(spec, options(tmp_path, workers=2))
    assert isinstance(driver.study.sampler, optuna.samplers.TPESampler)
    assert driver.run().done == 2
    trials = load(tmp_path).get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 2 and len(load(tmp_path).get_trials()) == 2
    for t in trials:
        assert 1e-3 <= t.params["optimizer.lr"] <= 5e-2
        run_dir = tmp_path / "runs" / "tiny" / t.user_attrs["run_dirs"][0]
        assert t.value == json.loads((run_dir / "metrics.json").read_text())["val_loss"]


@pytest.mark.slow
def test_pruning_by_global_step_stops_a_hopeless_run(tmp_path):
    grid = [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]},
            {"optimizer": ["sgd"], "optimizer.lr": [1e-6], "steps": [60], "sleep_s": [0.1]}]
    prune = {"enabled": True, "tag": "val_loss", "pruner": "median", "n_startup_trials": 1,
             "poll_s": 0.2}
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", grid=grid, seeds=[0], prune=prune,
                                  launch={"command": TRAINING}))
    driver = Driver(spec, options(tmp_path, workers=1))
    # The good run goes first (the plan's order is the grid's) and gives the median a curve.
    summary = driver.run()
    assert summary.done == 2
    study = load(tmp_path)
    (pruned,) = study.get_trials(states=(TrialState.PRUNED,))
    assert "optimizer=sgd" in pruned.user_attrs["run_key"]
    steps = sorted(pruned.intermediate_values)
    assert steps and steps[0] >= 1 and steps[-1] < 60  # reported by global step, stopped early
    run_dir = tmp_path / "runs" / "tiny" / pruned.user_attrs["run_dirs"][0]
    assert not (run_dir / "metrics.json").exists()


# ------------------------------------------------------------------- crashes, shared studies
def sweep_cli(sweep: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "muoneq", "sweep", str(sweep), "--runs-dir",
            str(tmp_path / "runs"), "--poll", "0.2", *extra]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("started", ["spawned", "warm"])
def test_killed_driver_loses_and_repeats_nothing(tmp_path, started):
    """A driver killed with SIGKILL: its running trials live on (a warm server ends with its
    driver, its trials do not), and the next driver adopts or tells them."""
    launched = {"launch": WARM_LAUNCH} if started == "warm" else {}
    sweep = write_sweep(tmp_path / "s.yaml", overrides=["steps=20", "sleep_s=1.5"], **launched)
    study_dir = tmp_path / "runs" / "tiny"
    proc = subprocess.Popen(sweep_cli(sweep, tmp_path, "--workers", "2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(study_dir.glob("trials/*/*/metrics.json"))) < 1:
        assert proc.poll() is None and time.time() < deadline, "the study never got going"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    records = [json.loads(p.read_text()) for p in study_dir.glob("trials/*/*/trial.json")]
    servers = {r["process"] for r in records if "process" in r}
    assert (servers == {"spawned"}) == (started == "spawned")
    for server in servers - {"spawned"}:  # it ends as its driver's end of the socket closes
        pid = int(server.split("pid ")[1].rstrip(")"))
        while _running(pid):
            assert time.time() < deadline + 60, "the warm server outlived its driver"
            time.sleep(0.1)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns)
              for p in study_dir.glob("trials/*/*/metrics.json")}
    assert len(before) < 4
    done = subprocess.run(sweep_cli(sweep, tmp_path, "--workers", "2"), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_each_run_once(load(tmp_path), study_dir, expected=4)
    for path, (content, mtime) in before.items():
        assert (path.read_bytes(), path.stat().st_mtime_ns) == (content, mtime)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


#: three runs for two drivers of one worker each: both get work
SHARED = {"overrides": ["steps=20", "sleep_s=1.5"], "seeds": [0, 1, 2],
          "grid": [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}]}


def _two_drivers(sweep: Path, tmp_path: Path, *extra: str) -> None:
    procs = [subprocess.Popen(sweep_cli(sweep, tmp_path, "--workers", "1", *extra),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]


def _check_shared(study: optuna.Study, study_dir: Path) -> None:
    assert_each_run_once(study, study_dir, expected=3)
    drivers = {t.user_attrs["driver"] for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert len(drivers) == 2, f"both drivers should have run trials, got {drivers}"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_drivers_share_a_study_on_the_journal_file(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", **SHARED)
    _two_drivers(sweep, tmp_path)
    _check_shared(load(tmp_path), tmp_path / "runs" / "tiny")


@pytest.fixture(scope="module")
def postgres_url():
    """A throw-away PostgreSQL 15 server on 127.0.0.1 (initdb refuses root: run as nobody)."""
    bindir = Path("/usr/lib/postgresql/15/bin")
    if not (bindir / "initdb").exists():
        pytest.skip(f"PostgreSQL 15 server binaries not found in {bindir} "
                    "(Debian: apt-get install postgresql-15)")
    pytest.importorskip("psycopg", reason="pip install 'muoneq[postgres]'")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="muoneq-pg-"))  # /tmp itself: reachable by nobody
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            shutil.rmtree(root)
            pytest.skip("running as root without runuser: cannot start PostgreSQL as nobody")
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        as_user = ["runuser", "-u", "nobody", "--"]
    port = free_port()
    data = root / "data"
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust",
                    "-U", "postgres", "--no-sync", "-E", "UTF8"], check=True,
                   capture_output=True)
    subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l",
                    str(root / "server.log"), "-w", "-o",
                    f"-h 127.0.0.1 -p {port} -k {root} -F", "start"], check=True,
                   capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w",
                        "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_drivers_share_a_study_on_postgresql(tmp_path, postgres_url):
    sweep = write_sweep(tmp_path / "s.yaml", study="tiny-pg", **SHARED)
    _two_drivers(sweep, tmp_path, "--storage", postgres_url)
    study = optuna.load_study(study_name="tiny-pg", storage=postgres_url)
    _check_shared(study, tmp_path / "runs" / "tiny-pg")
    assert not (tmp_path / "runs" / "tiny-pg" / "optuna.journal").exists()


def test_a_tpe_search_takes_an_int_axis(tmp_path, capsys):
    """``type: int`` bounds stay integers (the schema reads them as floats): the search's
    checks compose ``optimizer.ns_steps=2``, not ``2.0``, which the optimizer's Integer field
    refuses."""
    from muoneq.suite.sweeps.cli import main
    from muoneq.suite.sweeps.validate import search_points

    search = {"params": {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 1e-1,
                                          "log": True},
                         "optimizer.ns_steps": {"type": "int", "low": 2, "high": 6}},
              "n_trials": 2}
    path = write_sweep(tmp_path / "k.yaml", grid=[], search=search, seeds=[0],
                       experiment="cifar10_resnet18", launch={}, overrides=[],
                       objective={"metric": "test/acc", "direction": "maximize"})
    spec = load_sweep(path)
    k = spec.search.params["optimizer.ns_steps"]
    assert (k.low, k.high) == (2, 6) and type(k.low) is type(k.high) is int
    assert [p.as_dict()["optimizer.ns_steps"] for p in search_points(spec)] == [2, 2, 6]
    assert main([str(path), "--dry-run", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert "checked: 3 training configs compose" in capsys.readouterr().out


def test_dry_run_lists_runs_and_the_first_command(capsys):
    from muoneq.suite.sweeps.cli import main

    assert main([str(REPO / "sweeps" / "ablation-cifar10.yaml"), "--dry-run",
                 "--set", "seeds=[0]", "--override", "trainer.max_epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "33 points × 1 seeds = 33 runs" in out
    first = next(line for line in out.splitlines() if line.startswith("first command:"))
    assert " -m muoneq train experiment=cifar10_resnet18 trainer.max_epochs=1 optimizer=sgd " \
           "optimizer.lr=0.1 seed=0 run.dir=runs/ablation-cifar10/trials/" in first
    assert first.endswith("/seed0 resume=auto")
    assert ("checked: 25 training configs compose and type-check as `muoneq train` (every "
            "value of every axis, once in each config shape)") in out


def test_dry_run_says_cifar10_is_missing(tmp_path, caplog, capsys):
    """As the language studies say their shards are missing: a line before the runs, which
    are still listed (the machines that run the trials may hold the data)."""
    from muoneq.suite.sweeps.cli import main

    root = tmp_path / "nowhere"
    assert main(["ablation-cifar10", "--dry-run", "--runs-dir", str(tmp_path / "runs"),
                 "--override", f"task.data.root={root}"]) == 0
    (line,) = [r.getMessage() for r in caplog.records if "not on this machine" in r.getMessage()]
    assert f"CIFAR-10 not found at task.data.root={root} (a run with task.data.download=true " \
           "downloads it first, which needs the network)" in line
    assert "99 runs" in capsys.readouterr().out


def test_a_bad_point_stops_the_sweep_before_anything_starts(tmp_path, capsys):
    """A misspelled override or a bad grid value fails --dry-run and the real sweep alike,
    naming the point, before the study exists (so it is not locked to the mistake)."""
    from muoneq.suite.cli import main

    sweep = REPO / "sweeps" / "ablation-cifar10.yaml"
    runs = tmp_path / "runs"
    for extra in (["--dry-run"], []):
        assert main(["sweep", str(sweep), "--runs-dir", str(runs), "--override",
                     "optimizer.lrr=0.1", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("muoneq: point 'optimizer=sgd optimizer.lr=0.1' (seed 0) is not "
                              "a valid training config: ") and err.count("\n") == 1
        assert "optimizer.lrr" in err and "Did you mean: 'lr'" in err
        assert not runs.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(sweep.read_text().replace("optimizer.mode: [RC, C, R]",
                                             "optimizer.mode: [RC, X, R]"))
    assert main(["sweep", str(bad), "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "point 'optimizer=muoneq_nes optimizer.lr=0.1 optimizer.mode=X'" in err
    assert "optimizer.mode" in err and not runs.exists()
    search = tmp_path / "search.yaml"  # an open search is checked at its bounds
    search.write_text(yaml.safe_dump({
        "study": "s", "experiment": "cifar10_resnet18", "seeds": [0],
        "overrides": ["optimizer=sgd"], "objective": {"metric": "test/acc"},
        "search": {"params": {"optimizer.lr": {"low": -0.1, "high": 0.1}}}}))
    assert main(["sweep", str(search), "--dry-run"]) == 2
    assert "point 'optimizer.lr=-0.1'" in capsys.readouterr().err


def test_a_study_refuses_changed_fixed_settings(tmp_path):
    Driver(load_sweep(write_sweep(tmp_path / "s.yaml")), options(tmp_path))
    changed = load_sweep(write_sweep(tmp_path / "s.yaml", overrides=["steps=30"]))
    with pytest.raises(SweepError) as err:
        Driver(changed, options(tmp_path))
    message = str(err.value)
    # what changed, and every way out: restore, a new name, or delete the study
    assert err.value.details == ["overrides: ['steps=20'] → ['steps=30']"]
    for way_out in ("restore them", "--set study=NAME",
                    f"rm -r {tmp_path / 'runs' / 'tiny'}"):
        assert way_out in message, message
    grown = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0, 1, 2]))  # may grow
    assert len(Driver(grown, options(tmp_path)).ledger.expected) == 6


def test_workers_get_their_own_devices_and_launchers_are_templates(tmp_path):
    from muoneq.suite.sweeps.launch import trial_command

    torchrun = ("torchrun --standalone --nproc_per_node={nproc} -m muoneq train "
                "experiment={experiment} {overrides} seed={seed} run.dir={run_dir} resume=auto")
    launch = {"command": torchrun, "nproc": 2, "devices_per_trial": 2,
              "env": {"NCCL_DEBUG": "WARN"}}
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", launch=launch, experiment="cifar10_resnet18",
                                  overrides=["trainer.max_epochs=1"],
                                  objective={"metric": "test/acc", "direction": "maximize"}))
    driver = Driver(spec, options(tmp_path, workers=2, devices=["0", "1", "2", "3"]))
    assert check_trials(spec, driver.study_dir) == 2  # both compose as `muoneq train` configs
    assert driver.slots == [["0", "1"], ["2", "3"]]
    point = spec.points()[1]
    argv, env, fingerprint = trial_command(spec, point, 1, Path("runs/x"), devices=["2", "3"],
                                           worker=1)
    assert argv == ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "muoneq", "train",
                    "experiment=cifar10_resnet18", "trainer.max_epochs=1", "optimizer=muoneq_nes",
                    "optimizer.lr=0.02", "seed=1", "run.dir=runs/x", "resume=auto"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NCCL_DEBUG"] == "WARN"
    assert fingerprint == {"experiment": "cifar10_resnet18", "seed": 1,
                           "overrides": ["trainer.max_epochs=1", "optimizer=muoneq_nes",
                                         "optimizer.lr=0.02"]}
    with pytest.raises(SweepError, match="needs 6 devices, found 4"):
        Driver(spec, options(tmp_path, workers=3, devices=["0", "1", "2", "3"]))

    srun = "srun --nodes={nodes} --ntasks-per-node={nproc} {python} -m muoneq train {overrides} " \
           "run.dir={run_dir}"
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", launch={"command": srun,
                                                               "vars": {"nodes": 2}}))
    argv, _, _ = trial_command(spec, spec.points()[0], 0, Path("d"))
    assert argv[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"] and argv[-1] == "run.dir=d"


@pytest.mark.slow
def test_a_run_finished_after_its_driver_died_is_told_not_rerun(tmp_path):
    from muoneq.suite.sweeps.launch import trial_command

    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0], grid=[
        {"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}]))
    dead = Driver(spec, options(tmp_path))
    job = dead.scheduler.next_job()  # asked and recorded as dead's trial
    run_dir = job.point.run_dir(dead.study_dir, 0)
    argv, env, _ = trial_command(spec, job.point, 0, run_dir)
    subprocess.run(argv, env=env, check=True, capture_output=True)  # the process finishes,
    # but its driver died before telling: it never held its lock file, as after a SIGKILL.
    summary = Driver(spec, options(tmp_path)).run()
    assert (summary.done, summary.total) == (1, 1)
    (t,) = load(tmp_path).get_trials()
    assert (t.number, t.state) == (job.number, TrialState.COMPLETE)
    assert t.value == json.loads((run_dir / "metrics.json").read_text())["val_loss"]
    assert (run_dir / "starts.log").read_text().count("\n") == 1


@pytest.mark.parametrize(("workers", "environ", "launch_env", "expected"), [
    (2, None, {}, "half"),  # the cores shared out between the trials at once
    (1, None, {}, "unset"),  # one trial: torch's default (every core)
    (2, "1", {}, "1"),  # the environment's
    (2, None, {"OMP_NUM_THREADS": "3"}, "3"),  # launch.env's
])
def test_each_trial_s_threads_default_to_the_cores_shared_by_the_workers(
        tmp_path, monkeypatch, workers, environ, launch_env, expected):
    from muoneq.suite.sweeps.launch import cores

    if environ is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", environ)
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0],
                        launch={"command": COMMAND, "env": launch_env})
    assert Driver(load_sweep(sweep), options(tmp_path, workers=workers)).run().exit_code == 0
    found = {p.read_text() for p in (tmp_path / "runs" / "tiny").glob("trials/*/seed0/threads")}
    assert found == {str(max(1, cores() // 2)) if expected == "half" else expected}


def test_the_sweep_suggests_a_report_only_once_a_run_finished(tmp_path, capsys):
    from muoneq.suite.cli import main

    runs = ["--runs-dir", str(tmp_path / "runs"), "--poll", "0.1"]
    failing = write_sweep(tmp_path / "f.yaml", study="failing", seeds=[0],
                          overrides=["steps=20", "config_error=true"])
    assert main(["sweep", str(failing), *runs]) == 1
    out = capsys.readouterr().out
    assert "0/2 runs done, 2 failed for good" in out and "report:" not in out
    assert main(["sweep", str(write_sweep(tmp_path / "s.yaml", seeds=[0])), *runs]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("report: ")]
    assert line.endswith(f" report {tmp_path / 'runs' / 'tiny'}")
