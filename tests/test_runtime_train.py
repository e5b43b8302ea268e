"""End-to-end runs on CPU: every experiment file, the run folder, resume, 2-process DDP."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from muoneq.newton_schulz import dtype_name, resolve_dtype
from muoneq.suite.machine import device_name
from muoneq.suite.runtime import ConfigError, RunFolderError, compose, conf_dir, train
from muoneq.suite.runtime.checkpoints import BestCheckpoint
from muoneq.suite.runtime.config.identity import is_result_key
from muoneq.suite.runtime.metrics import TEXT_KEYS, metric_keys
from muoneq.suite.runtime.run import find_resume_checkpoint
from muoneq_tasks.vision.cifar10_data import load_cifar10, normalize
from muoneq_tasks.vision.resnet import CifarResNet
from tests.helpers.runtime import TINY_RUNS, Losses, StopAt, tiny
from tests.helpers.sweeps import scalars

EXPERIMENTS = sorted((conf_dir() / "experiment").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("one_thread")


def state_of(checkpoint: Path) -> dict:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


def evaluate(checkpoint: Path, data_root: str, width: int, blocks: list[int],
             split: slice | None = None) -> float:
    """Top-1 accuracy of a checkpoint's network, in one process: on the whole test set, or on
    the training images ``split`` selects."""
    model = CifarResNet(blocks=blocks, width=width)
    state = {k.removeprefix("model."): v for k, v in state_of(checkpoint).items()
             if k.startswith("model.")}
    model.load_state_dict(state)
    model.eval()
    data = load_cifar10(data_root)
    x, y = (data.x_test, data.y_test) if split is None else (data.x_train[split],
                                                             data.y_train[split])
    with torch.no_grad():
        predictions = model(normalize(x)).argmax(-1)
    return (predictions == y).float().mean().item()


def metrics_root(tmp_path: Path) -> str:
    """The tiny CIFAR archive that tiny() points task.data.root at."""
    return next(a.split("=", 1)[1] for a in tiny(tmp_path) if a.startswith("task.data.root="))


# ----------------------------------------------------------------------------- experiments
@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_runs_one_tiny_step(tmp_path, path):
    task_file = OmegaConf.load(path).defaults.task
    task = OmegaConf.load(conf_dir() / "task" / f"{task_file}.yaml").get("name", task_file)
    assert task in TINY_RUNS, f"add a tiny-run entry for task {task!r} to tests/helpers/runtime.py"
    cfg = compose([
        f"experiment={path.stem}", *TINY_RUNS[task](tmp_path), "trainer.max_epochs=null",
        "trainer.max_steps=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
        f"run.dir={tmp_path / 'run'}",
    ])
    metrics = train(cfg)
    assert metrics["global_step"] == 1 and metrics["status"] == "finished"
    assert metrics == json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert np.isfinite(metrics[metrics["paper_metric"]])  # test/acc, val/ppl
    # what a sweep checks its objective against before it runs anything
    # (muoneq.suite.runtime.metrics):
    # every key written with a value is declared (MFU, null on a CPU, is not: a sweep refuses
    # it as its objective), and those of TEXT_KEYS hold text, the others numbers (step times
    # are null after one step: the first is not timed)
    declared = set(metric_keys(cfg))
    valued = {k for k, v in metrics.items() if v is not None}
    assert valued <= declared and ("mfu" in declared) == (metrics.get("mfu") is not None)
    assert {k for k in valued if isinstance(metrics[k], str)} == valued & set(TEXT_KEYS)


# ----------------------------------------------------------------------------- run folder
def test_cifar_recipe_decays_the_lr_once_per_epoch_as_cosine_annealing(tmp_path):
    run = tmp_path / "run"
    cfg = compose(tiny(tmp_path, "trainer.max_epochs=3", f"run.dir={run}",
                       "trainer.log_every_n_steps=1"))
    assert cfg.schedule.interval.value == "epoch"
    train(cfg)
    # the authors' script: torch's CosineAnnealingLR(T_max=epochs), stepped after each epoch
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    annealing = torch.optim.lr_scheduler.CosineAnnealingLR(reference, T_max=3)
    per_epoch = []
    for _ in range(3):
        per_epoch.append(reference.param_groups[0]["lr"])
        reference.step()
        annealing.step()
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    for tag in ("lr/muon", "lr/adamw"):  # the matrix and the AdamW group
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == list(range(1, 13))  # 4 batches per epoch
        # the lr of the k-th optimizer step, at global step k
        np.testing.assert_allclose([v for _, v in logged],
                                   [per_epoch[(s - 1) // 4] for s, _ in logged], rtol=1e-6)


def test_spectra_section_measures_the_pre_ns_momentum_during_the_run(tmp_path):
    run = tmp_path / "run"
    cfg = compose(tiny(tmp_path, "trainer.max_epochs=2", f"run.dir={run}", "spectra.enabled=true",
                       "spectra.steps=[2,5]", "spectra.modes=[none,RC]",
                       "spectra.modules=['*conv*']", "spectra.log_figures=false"))
    train(cfg)
    [written] = run.rglob("spectra.csv")
    assert written.parent == run / "tensorboard"
    with written.open(newline="") as f:
        rows = list(csv.DictReader(f))
    # the CIFAR recipe puts every ≥2-D weight on the Muon path (the authors' routing)
    convs = {name for name, m in CifarResNet(blocks=[1], width=4).named_modules()
             if isinstance(m, torch.nn.Conv2d)}
    assert {(int(r["step"]), r["mode"]) for r in rows} == {(s, m) for s in (2, 5)
                                                           for m in ("none", "RC")}
    assert {r["module"].removeprefix("model.") for r in rows} == convs
    assert all(0 < float(r["stable_rank"]) <= min(int(r["m"]), int(r["n"])) for r in rows)

    with pytest.raises(ConfigError, match=r"spectra\.fractions"):
        compose(tiny(tmp_path, "spectra.enabled=true", "spectra.fractions=[0.0]"))


def test_run_folder_metrics_config_checkpoints_tensorboard(tmp_path, capsys):
    run = tmp_path / "run"
    # 8 of the 32 training images held out for validation: 3 steps of 8 per epoch
    cfg = compose(tiny(tmp_path, "trainer.max_epochs=3", f"run.dir={run}", "seed=3",
                       "trainer.log_every_n_steps=2", "task.data.val_size=8",
                       "trainer.progress=log"))
    metrics = train(cfg, argv=["experiment=cifar10_resnet18", "seed=3"])

    saved = json.loads((run / "metrics.json").read_text())
    assert saved == metrics
    assert saved["monitor"] == "val/acc" and saved["monitor_mode"] == "max"
    assert saved["paper_metric"] == "test/acc"
    assert saved["global_step"] == 9 and saved["epochs"] == 3 and saved["world_size"] == 1
    for key in ("best", "final", "test/acc", "test/loss", "step_time_s", "peak_memory_gb",
                "wall_clock_s", "train_seconds"):
        assert isinstance(saved[key], float) and saved[key] >= 0, key
    # what the step times were measured on: torch's threads, the cores, the machine's load
    assert (saved["threads"], saved["cores"]) == (torch.get_num_threads(), os.cpu_count())
    assert saved["device"] == device_name(torch.device("cpu"))
    assert 0 <= saved["load_avg"] <= saved["load_max"]
    assert saved["best"] >= saved["final"]  # max over the epochs' val/acc
    assert saved["best_val_acc"] == saved["best"]
    assert saved["peak_memory_kind"] == "host_rss"

    # test/acc is the final weights' accuracy on every test image, recomputed independently;
    # val/acc is theirs on the 8 held-out training images, never on the test set
    last = run / "checkpoints" / "last-step000000009.ckpt"
    assert find_resume_checkpoint(run) == last and (run / "checkpoints" / "best.ckpt").is_file()
    data_root = cfg.task.data.root
    assert saved["test/acc"] == pytest.approx(evaluate(last, data_root, 4, [1]), abs=1e-6)
    assert saved["val/acc"] == pytest.approx(
        evaluate(last, data_root, 4, [1], split=slice(-8, None)), abs=1e-6)

    written = OmegaConf.load(run / "config.yaml")
    assert written.seed == 3 and written.optimizer.name == "muoneq_nes"
    assert written.provenance.muoneq_version == saved["muoneq_version"]
    assert written.provenance.command == "muoneq train experiment=cifar10_resnet18 seed=3"
    assert len(written.provenance.git_commit or "") in (0, 40)
    assert written.provenance.world_size == 1 and len(written.provenance.fingerprint) == 16
    assert written.optimizer.ns_dtype == "auto"
    # what auto is on this CPU (float32, or bf16 where the CPU multiplies it natively)
    assert written.provenance.resolved.ns_dtype == dtype_name(resolve_dtype("auto", "cpu"))

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/acc", "best_val_acc", "test/acc", "metrics/best",
            "perf/step_time_s", "lr/muon", "lr/adamw"} <= tags
    hparams = set(events.PluginTagToContent("hparams"))
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= hparams
    # one step numbering: validations after each epoch at steps 3, 6, 9, as the console says
    val_steps = [e.step for e in events.Scalars("val/acc")]
    assert val_steps == [3, 6, 9] and [e.step for e in events.Scalars("test/acc")] == [9]
    console = capsys.readouterr().out
    assert [int(line.split()[3]) for line in console.splitlines()
            if line.startswith("epoch ") and "val/acc" in line] == val_steps
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert all(math.isfinite(e.value) for t in tags for e in events.Scalars(t))


def test_save_best_false_keeps_the_best_value_and_writes_no_best_checkpoint(tmp_path):
    run = tmp_path / "run"
    metrics = train(compose(tiny(tmp_path, "trainer.max_epochs=3", "task.data.val_size=8",
                                 f"run.dir={run}", "trainer.save_best=false")))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last-step000000009.ckpt", "last-step000000009.ckpt.sha256"]
    # the best validation value tracked and recorded all the same (the test above: the file)
    accuracies = [value for _, value in scalars(run)["val/acc"]]
    assert len(accuracies) == 3 and metrics["best"] == pytest.approx(max(accuracies))
    assert metrics["best_val_acc"] == metrics["best"]
    # where best.ckpt is kept decides nothing about the result: resume=auto takes either
    assert not is_result_key("trainer.save_best")


def test_the_best_checkpoint_keeps_the_state_key_of_lightnings_model_checkpoint(tmp_path):
    # a run checkpointed with Lightning's own ModelCheckpoint resumes with its best score
    ours = BestCheckpoint(tmp_path, "val/loss", "min", write=False)
    theirs = ModelCheckpoint(dirpath=tmp_path, filename="best", monitor="val/loss", mode="min",
                             save_top_k=1)
    assert ours.state_key == theirs.state_key


def test_cifar_without_a_validation_split_selects_nothing_on_the_test_set(tmp_path):
    """With the default task.data.val_size=0 the test set is used once, for the final weights:
    no validation, no best checkpoint, no "best" metric."""
    run = tmp_path / "run"
    metrics = train(compose(tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}")))
    assert metrics["monitor"] is None and metrics["best"] is None and metrics["final"] is None
    assert metrics["best_val_acc"] is None and not any(k.startswith("val/") for k in metrics)
    assert not (run / "checkpoints" / "best.ckpt").exists()
    tags = EventAccumulator(str(run / "tensorboard")).Reload().Tags()["scalars"]
    assert "test/acc" in tags and not [t for t in tags if t.startswith(("val/", "metrics/"))]
    assert metrics["test/acc"] == pytest.approx(
        evaluate(find_resume_checkpoint(run), metrics_root(tmp_path), 4, [1]), abs=1e-6)


# ----------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Reference run: 3 epochs of 4 steps, every step's loss and the final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    torch.set_num_threads(1)
    losses = Losses()
    train(compose(tiny(tmp, "trainer.max_epochs=3", f"run.dir={tmp / 'run'}")),
          callbacks=[losses])
    return tmp, losses.by_step, state_of(tmp / "run" / "checkpoints" / "last-step000000012.ckpt")


@pytest.mark.parametrize(
    ("checkpointing", "stop", "resumed_from"),
    [(["trainer.checkpoint_every_n_steps=3"], 8, 6),  # mid-epoch checkpoint (epoch 1, batch 2)
     ([], 7, 4)],  # end-of-epoch checkpoint
)
def test_resume_continues_the_same_trajectory(uninterrupted, tmp_path, checkpointing, stop,
                                              resumed_from):
    data_dir, reference_losses, reference_state = uninterrupted
    args = tiny(data_dir, "trainer.max_epochs=3", f"run.dir={tmp_path / 'run'}", *checkpointing)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(stop)])
    assert not (tmp_path / "run" / "metrics.json").exists()
    with pytest.raises(RunFolderError, match="resume=auto"):
        train(compose(args))

    losses = Losses()
    metrics = train(compose([*args, "resume=auto"]), callbacks=[losses])
    assert min(losses.by_step) == resumed_from + 1
    for step, loss in losses.by_step.items():
        assert loss == reference_losses[step], step  # bitwise: same batches, same updates
    state = state_of(tmp_path / "run" / "checkpoints" / "last-step000000012.ckpt")
    assert state.keys() == reference_state.keys()
    for key in state:
        assert torch.equal(state[key], reference_state[key]), key
    assert metrics["global_step"] == 12


@pytest.mark.slow
def test_resume_after_sigkill(uninterrupted, tmp_path):
    """A real process killed mid-run (possibly while writing a checkpoint) resumes exactly."""
    data_dir, reference_losses, reference_state = uninterrupted
    args = tiny(data_dir, "trainer.max_epochs=3", f"run.dir={tmp_path / 'run'}",
                "trainer.checkpoint_every_n_steps=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "muoneq", "train", *args], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 120
    while not list(checkpoints.glob("last-step*.ckpt")) and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "run" / "metrics.json").exists(), "the run ended before the kill"

    losses = Losses()
    train(compose([*args, "resume=auto"]), callbacks=[losses])
    for step, loss in losses.by_step.items():
        assert loss == reference_losses[step], step
    state = state_of(checkpoints / "last-step000000012.ckpt")
    for key in state:
        assert torch.equal(state[key], reference_state[key]), key


def folder_state(run: Path) -> dict[str, bytes]:
    """Every file of a run folder and its bytes (to check that a refusal touched nothing)."""
    return {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*"))
            if f.is_file()}


def test_resume_continues_only_the_same_run_and_touches_nothing_else(tmp_path, capsys):
    from muoneq.suite.cli import main

    args = tiny(tmp_path, "trainer.max_epochs=3", f"run.dir={tmp_path / 'run'}",
                "trainer.checkpoint_every_n_steps=3")
    with pytest.raises(RuntimeError, match="stopped by the test"):
        train(compose(args), callbacks=[StopAt(7)])
    before = folder_state(tmp_path / "run")
    assert "checkpoints/last-step000000006.ckpt" in before
    capsys.readouterr()

    # a changed hyper-parameter, or another optimizer: one line, one detail per key, exit 2
    assert main(["train", *args, "resume=auto", "optimizer.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"muoneq: {tmp_path / 'run'} was run with other settings (1 key "
                          "below differs), so resume=auto cannot continue it; restore")
    assert err.splitlines()[1:] == ["  optimizer.lr: 0.05 → 0.5"] and "Traceback" not in err
    assert main(["train", *args, "resume=auto", "optimizer=adamw"]) == 2
    err = capsys.readouterr().err
    assert "  optimizer.name: muoneq_nes → adamw" in err.splitlines()
    assert "  optimizer.lr: 0.05 → 0.001" in err.splitlines() and "Traceback" not in err
    assert folder_state(tmp_path / "run") == before  # config.yaml never describes another run

    # keys that cannot change the result may differ; the session is recorded, the config kept
    losses = Losses()
    train(compose([*args, "resume=auto", "trainer.log_every_n_steps=5"]), callbacks=[losses])
    assert min(losses.by_step) == 7
    written = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert written.trainer.log_every_n_steps == 50  # what the run was started with
    (session,) = written.provenance.resumed
    assert session.from_checkpoint == "last-step000000006.ckpt"
    assert list(session.changed) == ["resume: never → auto", "trainer.log_every_n_steps: 50 → 5"]

    # a finished run: same settings read back; another lr or a longer run is refused
    finished = folder_state(tmp_path / "run")
    assert main(["train", *args, "resume=auto"]) == 0
    assert "already finished with these settings" in capsys.readouterr().out
    assert main(["train", *args, "resume=auto", "optimizer.lr=0.5"]) == 2
    assert "cannot reuse its results" in capsys.readouterr().err
    assert main(["train", *args, "resume=auto", "trainer.max_epochs=4"]) == 2
    err = capsys.readouterr().err
    assert "holds a finished run of another length" in err and "is not extended" in err
    assert err.splitlines()[1:] == ["  trainer.max_epochs: 3 → 4"]
    assert folder_state(tmp_path / "run") == finished


def test_resume_checks_the_number_of_processes():
    from muoneq.suite.runtime import record

    cfg = compose(["experiment=cifar10_resnet18"])
    saved = {**record.resolved(cfg), "provenance": {"world_size": 2}}
    assert record.changed_settings(saved, cfg) == []
    assert record.changed_settings(saved, cfg, world_size=2) == []
    assert record.changed_settings(saved, cfg, world_size=1) == ["world_size: 2 → 1"]


def test_a_key_newer_than_the_run_is_the_same_setting_at_its_default():
    """Run folders made before a key existed (optimizer.split_fused, task.model.hf_*) still
    resume: the key was added with the default that keeps the old behaviour."""
    from muoneq.suite.runtime import record

    cfg = compose(["experiment=gpt2_small_fineweb"])
    old = record.resolved(cfg)
    del old["optimizer"]["split_fused"], old["task"]["model"]["hf_overrides"]
    assert record.changed_settings(old, cfg) == []
    split = compose(["experiment=gpt2_small_fineweb", "optimizer.split_fused=true"])
    assert record.changed_settings(old, split) == ["optimizer.split_fused: — → true"]
    # a key the run lacks whose value is not the schema's default is a difference
    del old["optimizer"]["lr"]  # the recipe's 0.002, not the optimizer's own default
    assert record.changed_settings(old, cfg) == ["optimizer.lr: — → 0.002"]


def test_a_new_run_replaces_an_attempt_that_saved_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="stopped by the test"):  # before any checkpoint
        train(compose(tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}",
                           "trainer.log_every_n_steps=1")), callbacks=[StopAt(2)])
    assert not find_resume_checkpoint(run) and (run / "tensorboard").is_dir()
    (run / "trial.log").write_text("the sweep's own files stay\n")
    metrics = train(compose(tiny(tmp_path, "trainer.max_epochs=1", f"run.dir={run}",
                                 "optimizer.lr=0.01", "trainer.log_every_n_steps=1")))
    assert "holds an earlier attempt that left no checkpoint to resume" in capsys.readouterr().out
    assert (run / "trial.log").exists() and metrics["global_step"] == 4
    assert OmegaConf.load(run / "config.yaml").optimizer.lr == 0.01
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("lr/muon")]
    assert logged == [(s, pytest.approx(0.01)) for s in (1, 2, 3, 4)]  # only this run's


def test_a_schedule_that_makes_no_sense_warns(tmp_path, capsys):
    train(compose(tiny(tmp_path, "trainer.max_epochs=2", f"run.dir={tmp_path / 'a'}",
                       "schedule.interval=step", "schedule.warmup_steps=20",
                       "schedule.total_steps=30")))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("muoneq: warning: ")]
    assert len(lines) == 2
    assert "schedule.warmup_steps=20 is not shorter than this run's 8 optimizer steps" in (
        lines[0]) and "last step uses 0.4 × optimizer.lr; lower schedule.warmup_steps" in lines[0]
    assert "schedule.total_steps=30 differs from this run's 8 optimizer steps" in lines[1]
    with pytest.raises(ConfigError, match=r"schedule.min_lr_ratio: must be in \[0, 1\]"):
        compose(tiny(tmp_path, "schedule.min_lr_ratio=1.5"))


# ----------------------------------------------------------------------------- DDP
@pytest.mark.distributed
def test_two_process_ddp_on_cpu(tmp_path):
    run = tmp_path / "run"
    args = tiny(tmp_path, "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp",
                "trainer.max_epochs=2", f"run.dir={run}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "muoneq", "train", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("muoneq train: finished") == 1  # printed by rank 0 only
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_step"] == 8  # 32 images / 16 per step
    # the sharded evaluation (no padding, sums all-reduced) equals a one-process evaluation
    last = find_resume_checkpoint(run)
    data_root = next(a.split("=", 1)[1] for a in args if a.startswith("task.data.root="))
    assert metrics["test/acc"] == pytest.approx(evaluate(last, data_root, 4, [1]), abs=1e-6)


def test_missing_data_is_one_line_with_where_to_put_it(tmp_path, capsys):
    from muoneq.suite.cli import main

    args = ["train", "experiment=cifar10_resnet18", f"task.data.root={tmp_path / 'none'}",
            "task.data.download=false", "trainer=cpu", f"run.dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("muoneq: ")]
    assert line.startswith(f"muoneq: CIFAR-10 not found at task.data.root={tmp_path / 'none'}; ")
    assert "task.data.download=true" in line and ".npz" in line and "Traceback" not in err
