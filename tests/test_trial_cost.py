"""What a sweep's trial pays besides its optimizer steps, and what it is told about the rest:
a run process imports only what it uses, per-step values are logged only where they are kept
(the same ones), ``trainer.compile=auto`` and the study's shared compile cache, the expected
remaining time of a sweep, and the benchmark that measures all this (smoke run).
"""

from __future__ import annotations

import datetime
import getpass
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from muoneq.suite.runtime import ConfigError, TaskModule, compose, train
from muoneq.suite.runtime.module import compiles
from muoneq.suite.sweeps import Driver, load_sweep
from muoneq.suite.sweeps.eta import duration, estimate
from muoneq.suite.sweeps.launch import COMPILE_CACHE_ENV, trial_command
from tests.helpers.commands import clean_env, make
from tests.helpers.language import language_shards, tiny_args  # noqa: F401 (a fixture)
from tests.helpers.runtime import tiny, tiny_language
from tests.helpers.sweeps import load, options, scalars, write_sweep

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- imports
@pytest.mark.slow
def test_a_language_run_imports_no_scipy_transformers_or_torchvision(tmp_path):
    args = ["experiment=llama_tiny_shakespeare", *tiny_language(tmp_path), "trainer.max_steps=2",
            "task.val_every_n_steps=2", f"run.dir={tmp_path / 'run'}"]
    code = textwrap.dedent(f"""
        import json, sys
        from muoneq.suite.cli import main
        assert main(["train", *{args!r}]) == 0
        print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in
                                ("scipy", "transformers", "torchvision", "lightning"))))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {m.partition(".")[0] for m in json.loads(done.stdout.splitlines()[-1])}
    assert loaded == {"lightning"}  # it trained with Lightning, and with nothing of the rest
    assert (tmp_path / "run" / "metrics.json").is_file()


# ----------------------------------------------------------------------------- allocator
FREED_AND_TAKEN_AGAIN = textwrap.dedent("""
    import ctypes, json, resource, torch
    from muoneq.suite.runtime.allocator import keep_freed_memory

    class Mallinfo2(ctypes.Structure):  # glibc's malloc.h
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2

    def rounds(n):  # what a step does: take 48 MB in blocks, free them, again
        faults, held = [], []
        for _ in range(n):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [torch.ones(6 << 20, dtype=torch.uint8) for _ in range(8)]
            del blocks
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            held.append(libc.mallinfo2().fordblks)  # free bytes the process keeps
        return faults, held

    _, held_by_default = rounds(1)
    kept = keep_freed_memory()
    print(json.dumps([held_by_default, kept, *rounds(4)]))
""")


def _glibc_mallinfo2() -> bool:
    version = os.confstr("CS_GNU_LIBC_VERSION") if sys.platform.startswith("linux") else None
    return version is not None and tuple(map(int, version.split()[1].split(".")[:2])) >= (2, 33)


@pytest.mark.skipif(not _glibc_mallinfo2(), reason="glibc >= 2.33's allocator (mallinfo2)")
def test_a_training_process_keeps_the_memory_a_step_frees():
    done = subprocess.run([sys.executable, "-c", FREED_AND_TAKEN_AGAIN], timeout=120,
                          capture_output=True, text=True, check=True)
    held_by_default, kept, faults, held = json.loads(done.stdout)
    freed = 8 * (6 << 20)
    assert kept is True
    # glibc by default maps each 6 MB block on its own and unmaps it when it is freed
    assert held_by_default[0] < freed // 8
    # kept: the 48 MB freed stay in the process, and the later rounds take them again without
    # faulting them in page by page (one round faults 48 MB / 4 kB = 12,288 pages)
    assert min(held) >= freed
    assert sum(faults[1:]) < freed // os.sysconf("SC_PAGE_SIZE") // 2


def test_load_train_sets_the_allocator_up(monkeypatch):
    calls = []
    monkeypatch.setattr("muoneq.suite.runtime.allocator.keep_freed_memory",
                        lambda: calls.append(True) or True)
    from muoneq.suite.runtime import cli

    cli.load_train(compose(["experiment=llama_tiny_shakespeare"]))
    assert calls == [True]


def test_lean_imports_hide_the_packages_only_while_lightning_is_imported():
    from lightning_utilities.core import imports

    from muoneq.suite.runtime.lean_imports import hidden

    with hidden():  # what torchmetrics and Lightning ask while they are imported
        assert not imports.RequirementCache("scipy>=1.0")
        assert not imports.RequirementCache("torchvision")
        assert not imports.package_available("transformers")
        assert not imports.package_available("scipy.signal")
        assert imports.RequirementCache("torch") and imports.package_available("numpy")
        bound = imports.package_available  # as `from ... import package_available` binds it
    assert imports.RequirementCache("scipy") and imports.package_available("scipy")
    assert bound("scipy")  # asked later through a name bound inside: the truth too


def test_lean_imports_still_hide_the_packages_on_the_installed_lightning():
    """lean_imports replaces a private method of lightning_utilities
    (``RequirementCache._check_requirement``) and its ``package_available`` while Lightning is
    imported; a release that renames either leaves ``muoneq train`` importing everything again,
    only slower, with no word: this test is that word."""
    from lightning_utilities.core import imports

    for owner, name in ((imports.RequirementCache, "_check_requirement"),
                        (imports, "package_available")):
        assert callable(getattr(owner, name, None)), (
            f"lightning_utilities has no {name} any more: muoneq.suite.runtime.lean_imports "
            "hides nothing; follow the new hook or remove lean_imports")
    code = ("import json, sys; from muoneq.suite.runtime.lean_imports import OPTIONAL, "
            "import_lightning; import_lightning(True); "
            "print(json.dumps(sorted(OPTIONAL & {m.partition('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], "Lightning imported them anyway"


# ----------------------------------------------------------------------------- logging
def test_step_values_are_logged_only_on_the_steps_that_keep_them(shards, tmp_path,
                                                                 monkeypatch):
    """Lightning writes step values every log_every_n_steps steps and metrics.json keeps the
    last step's: logging on those steps only keeps every number of a run that logs every
    step, and skips Lightning's logging on the others."""
    every = train(compose(tiny_args(shards, tmp_path / "every", "trainer.max_steps=10",
                                    "trainer.log_every_n_steps=1")))
    calls: list[str] = []
    log = TaskModule.log

    def counted(self, name, *args, **kwargs):
        calls.append(name)
        return log(self, name, *args, **kwargs)

    monkeypatch.setattr(TaskModule, "log", counted)
    sparse = train(compose(tiny_args(shards, tmp_path / "sparse", "trainer.max_steps=10",
                                     "trainer.log_every_n_steps=4")))
    # 10 steps of 2 micro-batches: logged on steps 4 and 8 (TensorBoard's) and 10 (the fit's
    # last, whose values metrics.json keeps): train/loss on both micro-batches of each, the
    # step's figures once
    per_step = [c for c in calls if c.startswith(("train/", "perf/"))]
    assert per_step.count("train/loss") == 3 * 2 and per_step.count("perf/tokens_per_s") == 3
    assert per_step.count("perf/step_time_s") == per_step.count("perf/peak_memory_gb") == 3

    kept, reference = scalars(tmp_path / "sparse"), scalars(tmp_path / "every")
    assert set(kept) == set(reference)
    for tag in ("train/loss", "lr/muon", "val/loss", "val/ppl"):
        steps = [s for s, _ in kept[tag]]
        assert kept[tag] == [p for p in reference[tag] if p[0] in steps], tag
    assert [s for s, _ in kept["train/loss"]] == [4, 8]
    assert [s for s, _ in kept["perf/step_time_s"]] == [4, 8]
    assert set(sparse) == set(every)
    # all but timings, the machine's load while they were measured, the folder and the lr
    # (Lightning's LearningRateMonitor logs on its own cadence: the last lr it logged)
    other = ("perf/", "step_time", "peak_memory", "train_seconds", "wall_clock", "tokens_per_s",
             "load_avg", "load_max", "run_dir", "mfu", "lr/")
    for key, value in every.items():
        if not any(t in key for t in other):
            assert sparse[key] == value, key


# ----------------------------------------------------------------------------- compile
@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cuda:0", True), ("auto", "cpu", False), ("auto", "mps", False),
    ("auto", "privateuseone:0", False), (True, "cpu", True), (False, "cuda:0", False),
])
def test_compile_auto_compiles_on_cuda_only(setting, device, expected, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # Triton is there
    assert compiles(setting, torch.device(device)) is expected


def test_compile_auto_runs_eager_on_cuda_without_triton(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "triton" else real(name))
    assert compiles("auto", torch.device("cuda:0")) is False


def test_compile_auto_runs_eager_on_a_cpu_and_the_run_records_it(tmp_path):
    seen = {}

    class Compiled(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen["compiled"] = pl_module._compiled

    run = tmp_path / "run"
    train(compose(tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")),
          callbacks=[Compiled()])
    written = OmegaConf.load(run / "config.yaml")
    assert written.trainer.compile == "auto" and seen["compiled"] is None
    assert written.provenance.resolved.compile is False

    train(compose(tiny(tmp_path, "trainer.max_epochs=1", "trainer.compile=false",
                       f"run.dir={tmp_path / 'eager'}")))
    assert "compile" not in OmegaConf.load(tmp_path / "eager" / "config.yaml").provenance.resolved


def test_compile_takes_true_false_or_auto(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.compile: 'yes please'; allowed: true, "
                                          r"false, auto"):
        compose(tiny(tmp_path, "trainer.compile=yes please"))


def test_trials_share_the_study_compile_cache_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    spec = load_sweep(write_sweep(tmp_path / "s.yaml"))
    point, study = spec.points()[0], tmp_path / "runs" / "tiny"
    run_dir = point.run_dir(study, 0)
    _, env, _ = trial_command(spec, point, 0, run_dir, study_dir=study)
    assert env[COMPILE_CACHE_ENV] == str(study.resolve() / "compile_cache")
    assert COMPILE_CACHE_ENV not in trial_command(spec, point, 0, run_dir)[1]

    monkeypatch.setenv(COMPILE_CACHE_ENV, "/scratch/mine")
    assert trial_command(spec, point, 0, run_dir, study_dir=study)[1][COMPILE_CACHE_ENV] == \
        "/scratch/mine"
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    launched = load_sweep(write_sweep(tmp_path / "l.yaml", launch={
        "command": spec.launch.command, "env": {COMPILE_CACHE_ENV: "/scratch/launch"}}))
    assert trial_command(launched, point, 0, run_dir, study_dir=study)[1][COMPILE_CACHE_ENV] == \
        "/scratch/launch"


ENV_PROGRAM = """
import json, os, sys
args = dict(word.split("=", 1) for word in sys.argv[1:])
os.makedirs(args["run.dir"], exist_ok=True)
with open(os.path.join(args["run.dir"], "metrics.json"), "w") as fh:
    json.dump({"val_loss": 1.0, "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}, fh)
"""


#: a Python user's script: the runtime imported first (importing torch._dynamo writes torch's
#: default compile cache folder into os.environ), then a driver of the sweep argv[1]
AFTER_TORCH = """
import json, os, sys
from pathlib import Path
import torch._dynamo
written = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
from muoneq.suite.sweeps import Driver, DriverOptions, load_sweep
summary = Driver(load_sweep(sys.argv[1]), DriverOptions(runs_dir=Path(sys.argv[2]))).run()
print(json.dumps({"written": written, "exit_code": summary.exit_code}))
"""


def env_sweep(tmp_path, **fields):
    """A sweep whose trials write the compile cache they were given into their metrics."""
    program = tmp_path / "env_program.py"
    program.write_text(ENV_PROGRAM)
    return write_sweep(tmp_path / "s.yaml", seeds=[0], launch={
        "command": f"{{python}} {program} {{overrides}} seed={{seed}} run.dir={{run_dir}}"},
        **fields)


def trial_caches(spec, study_dir) -> set[str]:
    return {json.loads((p.run_dir(study_dir, 0) / "metrics.json").read_text())["cache"]
            for p in spec.points()}


def torch_default_cache() -> str:
    """Where torch compiles by default (its cache_dir_utils.default_cache_dir, by hand)."""
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def test_a_driver_built_after_importing_torch_gives_its_trials_the_study_compile_cache(
        tmp_path):
    """Torch's default in the environment is nobody's choice: a script that imported the runtime
    (torch._dynamo) before it builds a driver still gets the study's cache for its trials."""
    path, runs = env_sweep(tmp_path), tmp_path / "runs"
    env = {k: v for k, v in clean_env().items() if k != COMPILE_CACHE_ENV}
    done = subprocess.run([sys.executable, "-c", AFTER_TORCH, str(path), str(runs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["exit_code"] == 0
    if torch.__version__ >= (2, 14):  # torch 2.9 writes it at its first compile, not at import
        assert result["written"] == torch_default_cache()
    assert trial_caches(load_sweep(path), runs / "tiny") == {
        str((runs / "tiny").resolve() / "compile_cache")}


def test_muoneq_sweep_mini_gives_its_trials_the_study_compile_cache(tmp_path):
    """``muoneq sweep --mini`` prepares its data, which imports the runtime, before its driver
    starts."""
    path = env_sweep(tmp_path, experiment="mini_llama", overrides=[], mini={
        "grid": [{"optimizer": ["muon_nes", "muoneq_nes"], "optimizer.lr": [0.02]}]})
    runs = tmp_path / "runs"
    env = {k: v for k, v in clean_env().items() if k != COMPILE_CACHE_ENV}
    done = subprocess.run([sys.executable, "-m", "muoneq", "sweep", str(path), "--mini",
                           "--runs-dir", str(runs)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert trial_caches(load_sweep(path, mini=True), runs / "tiny-mini") == {
        str((runs / "tiny-mini").resolve() / "compile_cache")}


# ----------------------------------------------------------------------------- when it ends
NOW = datetime.datetime(2026, 11, 26, 12, 0, 0)


def trial(started_s_ago: float, took_s: float | None = None, host: str = "here",
          **record) -> FrozenTrial:
    """A trial started ``started_s_ago`` seconds before NOW by a driver on ``host``; finished
    ``took_s`` later, as its driver measured it unless ``record`` says otherwise (its user
    attributes)."""
    start = NOW - datetime.timedelta(seconds=started_s_ago)
    done = took_s is not None
    attrs = {"host": host, **({"duration_s": took_s} if done else {}), **record}
    return FrozenTrial(
        number=0, trial_id=0, state=TrialState.COMPLETE if done else TrialState.RUNNING,
        value=1.0 if done else None, datetime_start=start,
        datetime_complete=start + datetime.timedelta(seconds=took_s) if done else None,
        params={}, distributions={}, user_attrs={k: v for k, v in attrs.items() if v is not None},
        system_attrs={}, intermediate_values={})


def test_the_remaining_time_is_the_hand_computed_one():
    finished = [trial(300, 10), trial(200, 20), trial(100, 30)]  # 20 s on average
    running = [trial(5), trial(50)]  # 15 s to go, and one slower than the average: 0
    # 6 left: 4 queued × 20 s + 15 s, at 2 workers: (80 + 15) / 2
    eta = estimate(finished, running, left=6, workers=2, here="here", now=NOW)
    assert eta.seconds == pytest.approx(47.5)
    assert (eta.trial_s, eta.measured, eta.parallel) == (20, 3, 2)
    assert eta.describe() == ("about 48 s left (2 at a time; a trial took 20 s on average, "
                              "3 measured)")
    # more trials running than this driver's workers (another driver): they set the pace
    assert estimate(finished, running, left=6, workers=1, here="here", now=NOW).parallel == 2
    assert estimate([], running, left=6, workers=2, here="here", now=NOW) is None  # none yet
    assert estimate(finished, [], left=0, workers=2, here="here", now=NOW) is None  # none left
    # a trial of another machine whose clock is 3 h ahead of this one (or in another time zone)
    # used to count as 3 h from its end: its start is never compared with this clock
    elsewhere = [trial(-3 * 3600, host="node7"), trial(50)]
    eta = estimate(finished, elsewhere, left=6, workers=2, here="here", now=NOW)
    assert eta.seconds == pytest.approx((4 * 20 + 20 / 2 + 0) / 2)  # half of a trial to go
    assert [duration(s) for s in (44.6, 600, 5400, 12_000)] == ["45 s", "10 min", "1.5 h",
                                                                "3.3 h"]


def test_a_finished_trials_time_is_read_off_one_clock():
    """A trial started by a driver on one machine and finished by another's (the first died)
    has its start and end stamps from two clocks, 3 h apart here: it used to count as 3 h. Its
    time is its driver's monotonic measure, else what its runs measured themselves."""
    two_clocks = trial(4 * 3600, 3 * 3600 + 20, duration_s=20)
    adopted = trial(3 * 3600, 3 * 3600 + 30, duration_s=None, seeds=[0, 1],
                    metrics_per_seed=[{"wall_clock_s": 10.0}, {"wall_clock_s": 20.0}])
    unmeasured = trial(200, 5, duration_s=None)  # an older study's, without either
    eta = estimate([two_clocks, adopted, unmeasured], [], left=2, workers=1, here="here",
                   now=NOW)
    assert (eta.trial_s, eta.measured, eta.seconds) == (25, 2, 50)


def test_the_progress_line_and_status_say_when_the_sweep_ends(tmp_path, caplog):
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0, 1], overrides=["sleep_s=0.3"])
    spec = load_sweep(sweep)
    with caplog.at_level(logging.INFO, logger="muoneq.suite.sweeps"):
        Driver(spec, options(tmp_path)).run()
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress")]
    assert len(progress) == 4 and progress[-1] == "progress: 4/4 runs done, 0 to go"
    assert re.fullmatch(r"progress: 1/4 runs done, 3 to go; about \d+ s left \(1 at a time; a "
                        r"trial took \d+ s on average, 1 measured\)", progress[0]), progress[0]

    # a study continued with one more seed: 2 runs left, measured on the 4 finished ones
    grown = write_sweep(tmp_path / "s.yaml", seeds=[0, 1, 2], overrides=["sleep_s=0.3"])
    study = load(tmp_path)
    took = [t.user_attrs["duration_s"] for t in study.trials]  # as its driver measured it
    status = subprocess.run([sys.executable, "-m", "muoneq", "sweep", str(grown), "--runs-dir",
                             str(tmp_path / "runs"), "--status"], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    mean = sum(took) / len(took)
    assert f"  about {duration(2 * mean)} left (1 at a time; a trial took {duration(mean)} on " \
           "average, 4 measured)" in status.stdout, status.stdout


# ----------------------------------------------------------------------------- benchmark
@pytest.mark.slow
def test_make_bench_trial_quick_says_what_it_measured(tmp_path):
    done = make("bench-trial", "QUICK=1", f"OUT={tmp_path}", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "trial_cpu_quick.json").read_text())
    for part in ("phases", "warm"):  # spawned as its command, forked by a warm server
        phases = result[part]["phases_s"]
        assert list(phases)[:3] == ["process start", "imports", "config"]
        assert "other 9 steps" in phases and list(phases)[-1] == "exit"
        assert sum(phases.values()) == pytest.approx(result[part]["wall_s"], rel=1e-6)
        assert 0 < result[part]["to_first_step_s"] < result[part]["wall_s"]
    assert result["warm"]["server_ready_s"] > 0 and result["warm"]["server_modules"] > 1000
    study = result["study"]
    assert study["trials"] == 2 and len(study["import_torch_all_s"]) == 6
    for name in ("warm", "spawned"):
        assert study[name]["per_trial_s"] == pytest.approx(study[name]["wall_s"] / 2)
        assert study[name]["per_import_torch"] == pytest.approx(
            study[name]["per_trial_s"] / study["import_torch_s"])
    assert study["warm"]["server_modules"] > 1000 and "server_modules" not in study["spawned"]
    for name in ("llama", "resnet"):
        loop = result["loop"][name]
        assert loop["raw_steps"] >= 2 and loop["loop_factor"] > 0 and loop["step_factor"] > 0
    assert "QUICK RUN: smoke values" in done.stdout
    assert "| phase | spawned s | share | warm s | share |" in done.stdout
    assert "| workload | steps |" in done.stdout
    assert "| trials | study s | per trial s | per trial / import torch | warm server |" in \
        done.stdout
    assert (tmp_path / "trial_cpu_quick.md").read_text().startswith("# make bench-trial")
