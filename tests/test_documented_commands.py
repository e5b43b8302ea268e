"""Every documented command, as written.

* Each Makefile target that can run on a CPU runs through ``make`` itself; only its documented
  knobs (``ARGS=``, ``OUT=``, ``QUICK=``, ``TEXT=``, ``STUDY=``) shorten it.
* Every shell command of the README and of the pages in ``docs/`` is parsed from those files
  (:data:`DOCUMENTED_PAGES`) and classified in :data:`README_COMMANDS` (a new command fails
  :func:`test_every_readme_command_is_classified` until it is): run as written in a fresh
  folder (shortened only by documented options where the real run takes hours), run as written
  expecting the one-line error a CPU-only offline machine must give, covered by a ``make`` or
  launcher test here, or skipped with the reason.
* The multi-node launches of ``docs/distributed.md`` run on loopback: two ``torchrun``
  launchers (c10d rendezvous, gloo, a tiny LLaMA, ``trainer.num_nodes=2``), and two processes
  with the variables ``srun`` sets; both must end with the weights one process reaches.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import optuna
import pytest
import torch
import yaml

from muoneq.suite.cli import main
from muoneq.suite.runtime import compose, train
from muoneq.suite.runtime.run import find_resume_checkpoint
from muoneq.suite.sweeps import load_sweep
from muoneq.suite.sweeps.storage import open_storage
from muoneq.suite.sweeps.validate import value_cover
from tests.helpers.commands import clean_env, make, one_line_error
from tests.helpers.language import make_documents, write_corpus
from tests.helpers.ports import free_port
from tests.helpers.report import add_trial
from tests.helpers.runtime import TINY_RUNS, tiny_cifar10

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
#: The front page and every topic page: where the documented commands live.
DOCUMENTED_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ helpers
def tiktoken_cache() -> str:
    """tiktoken's cache holding GPT-2's BPE (the shared data folder beside the checkout, as on
    CI), or skip: these commands need the real GPT-2 tokenizer, which cannot be made up."""
    for candidate in (os.environ.get("TIKTOKEN_CACHE_DIR"),
                      REPO.parent / "shared" / "data" / "tiktoken-cache"):
        if candidate and Path(candidate).is_dir() and any(Path(candidate).iterdir()):
            return str(candidate)
    pytest.skip("needs tiktoken's gpt2 files offline: set TIKTOKEN_CACHE_DIR")


def tiny_cifar_args(tmp_path: Path) -> list[str]:
    """The tiny CIFAR run of the runtime tests, with the recipe's own trainer."""
    return [a for a in tiny_cifar10(tmp_path) if a != "trainer=cpu"] + ["trainer.max_epochs=1"]


# ------------------------------------------------------------------------------ make targets
@pytest.mark.slow
def test_make_train_llama_tiny(tmp_path):
    env = clean_env(TIKTOKEN_CACHE_DIR=tiktoken_cache())
    text = write_corpus(tmp_path, "txt", make_documents(4000))  # ~40k GPT-2 tokens
    done = make("train-llama-tiny", f"TEXT={text}", f"OUT={tmp_path / 'shards'}",
                "ARGS=trainer.max_steps=2 task.val_every_n_steps=2 task.data.val_tokens=256 "
                f"task.data.batch_size=8 schedule.warmup_steps=1 run.dir={tmp_path / 'run'}",
                env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"muoneq train: finished {tmp_path / 'run'}: val/ppl=" in done.stdout
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["task"]["data"]["tokenizer"] == "gpt2"  # what `muoneq data` wrote
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["global_step"] == 2
    # offline, without GPT-2's BPE: the byte tokenizer
    byte = make("train-llama-tiny", f"TEXT={text}", f"OUT={tmp_path / 'bytes'}", "TOKENIZER=byte",
                "ARGS=trainer.max_steps=2 task.val_every_n_steps=2 task.data.val_tokens=256 "
                f"task.data.batch_size=8 schedule.warmup_steps=1 run.dir={tmp_path / 'b'}",
                env=clean_env(TIKTOKEN_CACHE_DIR=str(tmp_path / "no-cache")))
    assert byte.returncode == 0, byte.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    assert config["task"]["data"]["tokenizer"] == "byte"
    missing = make("train-llama-tiny")
    assert missing.returncode == 2
    assert one_line_error(missing.stderr).startswith("muoneq: no text given; pass TEXT=")


@pytest.mark.slow
def test_make_train_cifar10(tmp_path):
    run = tmp_path / "run"
    done = make("train-cifar10", "OPT=sgd", "SEED=1",
                "ARGS=" + " ".join([*tiny_cifar_args(tmp_path), f"run.dir={run}"]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"muoneq train: finished {run}: test/acc=" in done.stdout
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["optimizer"]["name"], config["seed"]) == ("sgd", 1)
    assert config["optimizer"]["lr"] == 0.05  # the recipe's (Table 7) SGD learning rate


@pytest.mark.slow
def test_make_figure_ns_geometry_quick(tmp_path):
    done = make("figure-ns-geometry", "QUICK=1",
                f"ARGS=--sizes 16x16,16x48 --seeds 1 --out {tmp_path / 'ns'}")
    assert done.returncode == 0, done.stderr[-3000:]
    figures = sorted(p.name for p in (tmp_path / "ns" / "figures").glob("*.png"))
    assert figures == ["decomposition_rotation.png", "decomposition_scale.png",
                       "fig1_rotation.png", "fig1_scale.png", "theorem_bound.png"]


@pytest.mark.slow
def test_make_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    done = make("bench", "QUICK=1", f"ARGS=--sets gpt2_small --repeats 1 --out {out}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["missing_peers"] == []
    assert result["cores"] == os.cpu_count()
    assert len(result["load_avg"]) == 2  # the lowest and highest load while it ran
    # the public Muon implementations of the bench extra, beside ours, in one process
    rows = result["sets"]["gpt2_small"]["contenders"]
    peers = ["heavyball Muon", "muon-optimizer SingleDeviceMuon"]
    assert list(rows)[-2:] == peers and {"torch.optim.Muon", "MuonEq-R"} <= set(rows)
    assert sorted(result["peers"].values()) == sorted(
        f"{d} {version(d)}" for d in ("heavyball", "muon-optimizer"))
    for name in peers:
        row = rows[name]
        assert row["ns_dtype"] == "bfloat16" and row["ms"] > 0
        # against a float64 run of its own schedule: bf16's rounding, no more
        assert 0 < row["err_gaussian"] < 4e-2 and 0 < row["err_decay"] < 0.2
        # one momentum buffer per matrix, as torch's (heavyball: and an 8-byte step count)
        assert 0 <= row["state_bytes"] - rows["torch.optim.Muon"]["state_bytes"] <= 8
    assert f"| {peers[0]} | bfloat16 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_make_report(tmp_path):
    sweep = {"study": "mini", "experiment": "cifar10_resnet18", "seeds": [0],
             "grid": [{"optimizer": ["muon_nes", "muoneq_nes"], "optimizer.lr": [0.05]}],
             "objective": {"metric": "test_acc", "direction": "maximize"}}
    (tmp_path / "mini.yaml").write_text(yaml.safe_dump(sweep))
    spec = load_sweep(tmp_path / "mini.yaml")
    study_dir = tmp_path / "runs" / "mini"
    study = optuna.create_study(study_name="mini", storage=open_storage(None, study_dir),
                                direction="maximize")
    from muoneq.suite.sweeps.spec import spec_to_dict

    study.set_user_attr("spec", spec_to_dict(spec))
    for i, p in enumerate(spec.points()):
        add_trial(study, (p.as_dict(), p.key), 0, 0.9 + 0.01 * i)
    done = make("report", f"STUDY={study_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| MuonEq-Nes | 0.05 |" in (study_dir / "report" / "table_table.md").read_text()


@pytest.mark.slow
def test_make_tensorboard_reads_a_study(tmp_path):
    """``make tensorboard STUDY=…`` runs this environment's TensorBoard (not the PATH's) on the
    study's view of short run names (a folder without one: the folder); without ``STUDY``, on
    every study's view and every other folder of ``RUNS``, each once, by its name.
    Without ``STUDY``, the studies' HParams configs are left out, so that TensorBoard infers one
    HParams view of every session, whose ``study`` says its study (one config of several would
    be picked at random, with its study's columns only). ``ARGS=--inspect`` reads the events
    instead of starting the server."""
    from torch.utils.tensorboard import SummaryWriter

    from muoneq.suite.sweeps import Driver
    from tests.helpers.sweeps import options, session, write_sweep

    runs = tmp_path / "runs"
    with SummaryWriter(str(runs / "plain" / "tensorboard")) as w:  # a `muoneq train` run
        w.add_scalar("val/ppl", 5.0, 1)
    sweep = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0]))
    assert Driver(sweep, options(tmp_path)).run().done == 2
    env = clean_env(PATH="/usr/bin:/bin")

    def inspected(*args: str) -> list[str]:
        done = make("tensorboard", *args, "ARGS=--inspect", env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return sorted(re.findall(r"^Event statistics for (.*):$", done.stdout, re.MULTILINE))

    done = make("tensorboard", f"STUDY={runs / 'plain'}", "ARGS=--inspect", env=env)
    assert done.returncode == 0 and "val/ppl" in done.stdout, done.stderr[-3000:]
    view = runs / "tiny" / "tensorboard"
    assert inspected(f"STUDY={runs / 'tiny'}") == sorted(
        str(view / name) for name in ("hparams", "muon_nes/seed0",
                                      "muoneq_nes/seed0"))
    # every study under a temporary folder of links, without its HParams config: TensorBoard
    # infers one view of every study's sessions, each saying its study
    every = inspected(f"RUNS={runs}")
    assert [os.path.relpath(p, os.path.commonpath(every)) for p in every] == [
        "plain/tensorboard", "tiny/muon_nes/seed0", "tiny/muoneq_nes/seed0"], every
    sessions = [session(d)[1] for d in (runs / "tiny" / "trials").glob("*/seed0")]
    assert [s["study"] for s in sessions] == ["tiny", "tiny"]


@pytest.mark.slow
def test_make_sweep_targets_dry_run_compose_every_value(tmp_path):
    """Each paper study's target, as documented with ARGS=--dry-run: every value of every axis
    composes in each config shape, and the report step is left out."""
    done = make("-j2", *SWEEPS, f"ARGS=--dry-run --runs-dir {tmp_path}", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in SWEEPS:
        spec = load_sweep(REPO / "sweeps" / f"{name}.yaml")
        points = len(spec.points())
        assert f"study {name}: {points} points × {len(spec.seeds)} seeds" in done.stdout
    checked = re.findall(r"checked: (\d+) training configs compose", done.stdout)
    assert sorted(map(int, checked)) == sorted(
        len(value_cover(load_sweep(REPO / "sweeps" / f"{n}.yaml").points())) for n in SWEEPS)
    assert "written to" not in done.stdout and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_sweep_target_reports_the_study_its_args_name(tmp_path):
    """``make ksweep-gpt2 ARGS="--set study=… --runs-dir …"``: the chained report is the
    study the sweep ran, in the folder it ran in (it looked for runs/ksweep-gpt2 and stopped
    with make's Error 2). The trials are the objective program (no training)."""
    from tests.helpers.sweeps import OBJECTIVE

    command = f"{{python}} {OBJECTIVE} {{overrides}} seed={{seed}} run.dir={{run_dir}}"
    done = make("ksweep-gpt2", f"ARGS=--runs-dir {tmp_path} --set study=renamed "
                f"--set 'launch.command=\"{command}\"' --override metric=val/ppl")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "study renamed: 12/12 runs done" in done.stdout
    assert (tmp_path / "renamed" / "report" / "report.md").read_text().startswith("# renamed\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["renamed"]


# ------------------------------------------------------------------------ documented commands
@dataclass
class Doc:
    """How a documented command is exercised."""

    kind: str  #: run | cpu_error | make | launch | skip
    detail: str = ""  #: expected output (run), error text (cpu_error), or the reason
    shorten: list[str] = field(default_factory=list)  #: documented options that shorten a run
    setup: str = ""  #: name of the files the command expects in its folder


MAKE_TEST = "a test of this module runs this target through make"
README_COMMANDS: dict[str, Doc] = {
    "make demo": Doc("skip", "the main job itself, minutes on 2 cores: make miniatures times it"),
    "pip install .": Doc("skip", "tests/test_packaging.py builds the wheel and installs it"),
    "make ksweep-gpt2 MINI=1": Doc("make", "tests/test_miniatures.py runs every miniature "
                                           "through make"),
    "make heatmap-gpt2 MINI=1 WORKERS=4": Doc("make", "tests/test_miniatures.py runs it "
                                                      "through make (WORKERS: trials at once)"),
    "make miniatures": Doc("skip", "every miniature in turn, minutes each; each is tested "
                                   "through its make target in tests/test_miniatures.py"),
    "muoneq train experiment=cifar10_resnet18 optimizer=muoneq_nes optimizer.lr=5e-2 seed=1":
        Doc("run", "muoneq train: finished runs/cifar10_resnet18-muoneq_nes-seed1-",
            shorten=["<tiny cifar>"]),
    "python -m muoneq train ...": Doc("skip", "the line above, through python -m"),
    "muoneq train --help": Doc("run", "experiment cifar10_resnet18"),
    "muoneq train experiment=cifar10_resnet18 trainer=gpu":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=cifar10_resnet18 trainer=ddp trainer.devices=4":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=llama350m_c4 trainer=fsdp2 trainer.devices=8":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 -m "
    "muoneq train experiment=llama130m_c4 trainer=ddp trainer.devices=4 trainer.num_nodes=2":
        Doc("launch", "test_torchrun_on_two_nodes_ends_where_one_process_does"),
    "srun python -m muoneq train experiment=llama130m_c4 trainer=ddp trainer.devices=4 "
    "trainer.num_nodes=2": Doc("launch", "test_slurm_tasks_end_where_one_process_does"),
    "torchrun --nproc-per-node=8 -m muoneq train experiment=llama130m_c4 trainer=npu "
    "trainer.devices=8": Doc("cpu_error", "torch_npu (and the CANN toolkit), which is not "
                                          "installed; install"),
    "make train-cifar10 OPT=muoneq_nes SEED=1 ARGS=optimizer.mode=RC trainer=ddp "
    "trainer.devices=4": Doc("make", MAKE_TEST),
    "make data-fineweb TOKENS=10.5B OUT=data/fineweb": Doc("skip", "downloads FineWeb"),
    "make data-c4 TOKENS=21B OUT=data/c4": Doc("skip", "downloads C4 and T5's tokenizer"),
    "muoneq data --source corpus/*.parquet --out data/mine --tokens 1B --workers 8":
        Doc("run", "data/mine: val ", shorten=["--val-tokens", "2000"], setup="parquet"),
    "muoneq data --source train.jsonl.gz --val-source val.jsonl --out data/mine":
        Doc("run", "data/mine: val ", shorten=["--val-tokens", "2000"], setup="jsonl"),
    "muoneq train experiment=gpt2_small_fineweb task.data.dir=/data/fineweb10B "
    "optimizer=muoneq_nes trainer.devices=8":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=llama130m_c4 optimizer=muoneq_nes task.data.dir=data/c4":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=gpt2_small_fineweb optimizer=muoneq_nes optimizer.mode=RC":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=llama130m_c4 optimizer=muoneq_nes task.model.arch=hf "
    "task.model.hf_model_type=qwen2 task.model.size=130m":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "muoneq train experiment=gpt2_small_fineweb optimizer=muoneq_nes optimizer.split_fused=true":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "make train-llama-tiny TEXT=path/to/tinyshakespeare.txt": Doc("make", MAKE_TEST),
    "make figure-ns-geometry QUICK=1": Doc("make", MAKE_TEST),
    "make figure-ns-geometry": Doc("skip", "the paper's sizes: GPU or many cores (QUICK=1 runs "
                                           "the same code)"),
    "muoneq spectra --sizes 64x256 --kappas 10,1e3 --ranges 100 --seeds 3 --out runs/mine":
        Doc("run", "figures:"),
    "muoneq train experiment=gpt2_small_fineweb optimizer=muon_nes spectra.enabled=true "
    "spectra.modules=['model.blocks.[0-3].*'] spectra.fractions=[0.01,0.1,0.5,1.0]":
        Doc("cpu_error", "trainer.accelerator=cuda: this machine has no usable CUDA GPU"),
    "make ablation-cifar10 ARGS=--dry-run": Doc("make", MAKE_TEST),
    "muoneq sweep sweeps/ablation-cifar10.yaml --workers 4 --set launch.devices_per_trial=1":
        Doc("cpu_error", "--workers 4 × launch.devices_per_trial 1 needs 4 devices, found 0"),
    "muoneq sweep sweeps/ablation-cifar10.yaml --status":
        Doc("run", "study ablation-cifar10 (journal:runs/ablation-cifar10/optuna.journal): "
                   "not started"),
    "pip install optuna-dashboard": Doc("skip", "installs from the package registry"),
    "optuna-dashboard runs/heatmap-gpt2/optuna.journal":
        Doc("skip", "a web server on a finished study; tests/test_sweeps_optuna.py checks the "
                    "params, distributions and trials_dataframe() it reads"),
    "make tensorboard STUDY=runs/heatmap-gpt2": Doc("make", MAKE_TEST),
    "make gpu-check": Doc("make", "tests/test_gpu_check.py runs it through make, QUICK=1"),
    "make gpu-wheels": Doc("skip", "downloads wheels from the package registry"),
    "MUONEQ_GIT_COMMIT=<hash> bash benchmarks/gpu_machine.sh check":
        Doc("skip", "for a GPU machine; tests/test_gpu_check.py runs it with a stand-in wheel"),
    "make bench": Doc("skip", "minutes on a CPU (QUICK=1 runs the same code through make)"),
    "make bench-trial": Doc("make", "tests/test_trial_cost.py runs it through make, QUICK=1"),
    "muoneq bench --sets gpt2_small": Doc("skip", "minutes on a CPU (the smoke run of the same "
                                                  "code is tested through make)"),
    "muoneq bench --peers only": Doc("skip", "minutes on a CPU (tests/test_bench_peers.py runs "
                                             "it on the quick set)"),
}


def readme_commands() -> dict[str, list[str]]:
    """The commands of the ``bash`` blocks of the README and ``docs/`` (continuations joined,
    comments dropped): their words (as the shell passes them) by their words joined with single
    spaces."""
    text = "\n".join(page.read_text() for page in DOCUMENTED_PAGES)
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands[" ".join(words)] = words
    return commands


def test_every_readme_command_is_classified():
    assert sorted(readme_commands()) == sorted(README_COMMANDS)
    names = {n for n in globals() if n.startswith("test_")}
    for doc in README_COMMANDS.values():
        assert doc.kind in ("run", "cpu_error", "make", "launch", "skip")
        if doc.kind == "launch":
            assert doc.detail in names


def _setup_files(kind: str, folder: Path) -> None:
    if kind == "parquet":
        (folder / "corpus").mkdir()
        for i in range(2):
            write_corpus(folder / "corpus", "parquet", make_documents(150, seed=i), f"part{i}")
    elif kind == "jsonl":
        write_corpus(folder, "json.gz", make_documents(300), "train")
        (folder / "train.json.gz").rename(folder / "train.jsonl.gz")
        write_corpus(folder, "jsonl", make_documents(150, seed=5), "val")


@pytest.mark.parametrize("command", [c for c, d in README_COMMANDS.items()
                                     if d.kind in ("run", "cpu_error")])
def test_readme_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    """In a fresh folder beside the checkout's sweeps/, in this process (``muoneq`` is
    ``muoneq.suite.cli:main``; a launcher line runs the command it launches)."""
    doc = README_COMMANDS[command]
    words = readme_commands()[command]
    if words[0] == "torchrun":  # the command torchrun starts on each process
        words = words[words.index("-m") + 1:]
    argv = words[3:] if words[:3] == ["python", "-m", "muoneq"] else words[1:]
    assert words[0] in ("muoneq", "python", "torchrun"), command
    if doc.kind == "cpu_error" and torch.cuda.is_available():
        pytest.skip("a GPU machine: these commands would start real training")
    if "<tiny cifar>" in doc.shorten:
        doc = Doc(doc.kind, doc.detail, tiny_cifar_args(tmp_path))
    if "gpt2" in command or doc.setup or words[1] == "data":
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiktoken_cache())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").symlink_to(REPO / "sweeps")
    _setup_files(doc.setup, tmp_path)
    code = main([*argv, *doc.shorten])
    out, err = capsys.readouterr()
    if doc.kind == "cpu_error":
        assert code == 2, (out + err)[-3000:]
        assert doc.detail in one_line_error(err)
    else:
        assert code == 0, (out + err)[-3000:]
        assert doc.detail in out


# ------------------------------------------------------------------------- multi-node launches
def language_args(tmp_path: Path) -> list[str]:
    """The recipe's overrides for a 3-step run of a tiny LLaMA on tiny shards, on the CPU."""
    tiny = [a for a in TINY_RUNS["language"](tmp_path) if a != "trainer=cpu"]
    return ["experiment=llama130m_c4", *tiny, "trainer.accelerator=cpu",
            "trainer.precision=32-true", "trainer.max_steps=3", "task.val_every_n_steps=3",
            "trainer.checkpoint_every_n_steps=3", "schedule.warmup_steps=1",
            "optimizer.ns_dtype=float32", "trainer.progress=quiet"]


def final_weights(run_dir: Path) -> dict:
    checkpoint = find_resume_checkpoint(run_dir)
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the same run in one process (``trainer=cpu``)."""
    tmp = tmp_path_factory.mktemp("one")
    args = language_args(tmp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(compose([*args, "trainer=cpu", f"run.dir={tmp / 'run'}"]))
    finally:
        torch.set_num_threads(threads)
    return args, final_weights(tmp / "run")


def assert_same_weights(run_dir: Path, reference: dict) -> None:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_step"] == 3
    weights = final_weights(run_dir)
    assert weights.keys() == reference.keys()
    for name in reference:  # the global batch is split, so reductions differ in rounding only
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=1e-6)


def wait_all(procs: list[subprocess.Popen], timeout: int = 300) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_on_two_nodes_ends_where_one_process_does(one_process, tmp_path):
    """The torchrun line of ``docs/distributed.md``, one process per "node", both nodes on
    this machine."""
    args, reference = one_process
    torchrun = Path(sys.executable).with_name("torchrun")
    endpoint = f"127.0.0.1:{free_port()}"
    command = [str(torchrun), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", "-m", "muoneq", "train", "trainer=ddp",
               "trainer.devices=1", "trainer.num_nodes=2", *args, f"run.dir={tmp_path / 'run'}"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=clean_env()) for _ in range(2)]
    wait_all(procs)
    assert_same_weights(tmp_path / "run", reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_tasks_end_where_one_process_does(one_process, tmp_path, monkeypatch, capsys):
    """The srun line of ``docs/distributed.md``: two tasks on two "nodes" with the variables
    srun sets (the port comes from the job id, as Lightning derives it)."""
    args, reference = one_process
    port = free_port(15000, 19999)
    slurm = {"SLURM_JOB_ID": f"7{port - 15000:04d}", "SLURM_JOB_NAME": "muoneq",
             "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2",
             "SLURM_NODELIST": "127.0.0.1", "SLURM_LOCALID": "0"}
    command = [sys.executable, "-m", "muoneq", "train", "trainer=ddp", "trainer.devices=1",
               "trainer.num_nodes=2", *args, f"run.dir={tmp_path / 'run'}"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=clean_env(**slurm, SLURM_PROCID=str(rank),
                                                       SLURM_NODEID=str(rank)))
             for rank in range(2)]
    wait_all(procs)
    assert_same_weights(tmp_path / "run", reference)
    # trainer.devices must match --ntasks-per-node: the documented 4 against 1 task per node
    for key, value in {**slurm, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    code = main(["train", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2", *args,
                 f"run.dir={tmp_path / 'bad'}"])
    assert code == 2
    line = one_line_error(capsys.readouterr().err)
    assert "`--ntasks-per-node=1` does not match" in line and "trainer.devices (4)" in line
    assert not (tmp_path / "bad").exists()  # refused before anything was written


# ------------------------------------------------------------------------- documented Python
def test_the_documented_python_that_reads_a_study_runs(tmp_path, monkeypatch, capsys):
    """docs/sweeps.md's snippet, as written, on a study named as it names it (the trials run the
    objective program, writing ``val/ppl``)."""
    from muoneq.suite.sweeps import Driver
    from tests.helpers.sweeps import options, write_sweep

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "sweeps.md").read_text(), re.S)
    (snippet,) = [b for b in blocks if "load_study" in b]
    sweep = write_sweep(tmp_path / "demo.yaml", study="demo", seeds=[0, 1],
                        overrides=["steps=20", "metric=val/ppl"],
                        objective={"metric": "val/ppl", "direction": "minimize"},
                        grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.1, 0.3]}])
    assert Driver(load_sweep(sweep), options(tmp_path)).run().exit_code == 0
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/sweeps.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'key': 'optimizer=muon_nes optimizer.lr=0.3', 'val/ppl': 0.0005" in out
    header, *rows = out.splitlines()[1:]
    assert header.split() == ["number", "params_optimizer.lr", "user_attrs_seed", "value_val/ppl",
                              "user_attrs_outcome"]
    assert [row.split()[1:3] for row in rows] == [["0.1", "0"], ["0.1", "1"], ["0.3", "0"],
                                                  ["0.3", "1"]]


# -------------------------------------------------------------------------- documented signature
def test_readme_signature_of_muoneq_is_the_real_one():
    """The ``MuonEq(...)`` line of ``docs/library.md`` lists exactly
    ``muoneq.optim.signature(MuonEq)``: the same names in the same order, the same kinds
    (keyword-only after ``*``) and defaults."""
    import ast
    import inspect

    from muoneq import MuonEq
    from muoneq.optim import signature

    text = " ".join((REPO / "docs" / "library.md").read_text().split())
    (documented,) = re.findall(r"`MuonEq\((params, \*, [^`]*)\)`", text)
    tree = ast.parse(f"def MuonEq({documented}): pass").body[0].args
    real = signature(MuonEq).parameters
    assert [a.arg for a in tree.args] == ["params"] and not tree.defaults
    assert [a.arg for a in tree.kwonlyargs] == list(real)[1:]
    for arg, default in zip(tree.kwonlyargs, tree.kw_defaults, strict=True):
        assert real[arg.arg].kind is inspect.Parameter.KEYWORD_ONLY
        assert ast.literal_eval(default) == real[arg.arg].default, arg.arg
