"""A 2-trial grid through the real ``muoneq train`` (ResNet-18 on tiny CIFAR-format data),
then its report: the sweep driver and the runtime agree on the trial contract, and a changed
experiment file never reuses the runs made with the old one."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.plugins.hparams import metadata

from muoneq.suite.report import load_study_data, write_report
from muoneq.suite.runtime import conf_dir
from muoneq.suite.sweeps import Driver, DriverOptions, SweepError, load_sweep
from tests.helpers.runtime import tiny_cifar10
from tests.helpers.sweeps import read, session

pytest.importorskip("muoneq.suite.runtime.run")


@pytest.mark.slow
@pytest.mark.distributed
def test_grid_of_real_training_runs(tmp_path, monkeypatch):
    conf = tmp_path / "conf"  # a copy of conf/, to edit an experiment file later
    shutil.copytree(conf_dir(), conf)
    monkeypatch.setenv("MUONEQ_CONF_DIR", str(conf))  # for the driver and its trials
    sweep = {
        "study": "cifar-mini",
        "experiment": "cifar10_resnet18",
        "overrides": [*tiny_cifar10(tmp_path), "trainer.max_epochs=1", "task.data.val_size=8"],
        "seeds": [0],
        "grid": [{"optimizer": ["muon_nes", "muoneq_nes"], "optimizer.lr": [0.05]}],
        "objective": {"metric": "test/acc", "direction": "maximize"},
        "report": {"tables": [{"name": "ablation",
                               "metrics": [{"key": "test/acc", "scale": 100}]}],
                   "curves": {"tags": ["val/acc"]}},
    }
    path = tmp_path / "cifar-mini.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    runs = tmp_path / "runs"
    summary = Driver(load_sweep(path), DriverOptions(workers=2, runs_dir=runs, tick_s=0.2)).run()
    assert (summary.done, summary.total, summary.exit_code) == (2, 2, 0)
    data = load_study_data(path, runs_dir=runs)
    assert sorted(r["optimizer"] for r in data.runs) == ["muon_nes", "muoneq_nes"]
    for r in data.runs:
        metrics = json.loads((tmp_path / r["_run_dir"] / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["optimizer"] == r["optimizer"]
        assert r["test/acc"] == metrics["test/acc"]
        config = yaml.safe_load((tmp_path / r["_run_dir"] / "config.yaml").read_text())
        assert config["optimizer"]["lr"] == 0.05 and config["seed"] == 0
        # one HParams row per run, the sweep's: the training process declared no session
        group, hparams, scalars = session(tmp_path / r["_run_dir"])
        assert group == f"optimizer={r['optimizer']}"  # lr: one value, not swept
        assert hparams["optimizer.mode"] == config["optimizer"]["mode"]
        assert scalars["test/acc"] == pytest.approx(metrics["test/acc"], rel=1e-6)
        # the sweep's session is the run's only one: none in the training process' own events,
        # which are the same TensorBoard run (one run per run folder)
        own = [f for f in (tmp_path / r["_run_dir"] / "tensorboard").glob("events.out.*")
               if not f.name.endswith(".hparams")]
        assert own
        for events in own:
            with pytest.raises(KeyError):
                read(events).PluginTagToContent(metadata.PLUGIN_NAME)
    report = write_report(data)
    table = (report.out_dir / "table_ablation.md").read_text()
    assert "| Muon-Nes | 0.05 |" in table and "| MuonEq-Nes | 0.05 |" in table
    assert (report.out_dir / "curve_val_acc.png").exists()

    # Re-running the sweep reuses its finished runs (same settings: nothing is launched) …
    folders = {p: p.stat().st_mtime_ns for p in (runs / "cifar-mini").rglob("*.json")}
    assert Driver(load_sweep(path), DriverOptions(runs_dir=runs, tick_s=0.2)).run().done == 2
    assert {p: p.stat().st_mtime_ns for p in folders} == folders
    # … but after an edit of the experiment file, it refuses them, naming the change
    recipe = conf / "experiment" / "cifar10_resnet18.yaml"
    recipe.write_text(recipe.read_text().replace("min_lr_ratio: 0.0", "min_lr_ratio: 0.1"))
    with pytest.raises(SweepError) as err:
        Driver(load_sweep(path), DriverOptions(runs_dir=runs))
    assert "made with other settings" in str(err.value) and "--set study=NAME" in str(err.value)
    assert err.value.details == ["schedule.min_lr_ratio: 0.0 → 0.1"]


def test_the_demo_names_its_own_way_out_of_a_study_made_otherwise(tmp_path, capsys):
    """`muoneq demo` has no --set: its refusal says what the demo accepts."""
    from muoneq.suite.cli import main
    from muoneq.suite.demo import demo_sweep
    from muoneq.suite.sweeps.spec import spec_from_dict
    from muoneq.suite.sweeps.study import open_study

    study_dir = tmp_path / "runs" / "demo"
    older = demo_sweep(study_dir / "data")
    older["overrides"] = [*older["overrides"], "trainer.max_steps=10"]
    open_study(spec_from_dict(older), None, study_dir)  # a demo study of another version
    assert main(["demo", "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.splitlines()
    (at,) = [i for i, line in enumerate(err) if line.startswith("muoneq: ")]
    first, details = err[at], err[at + 1:]
    assert first == (f"muoneq: {study_dir} holds a demo run with other settings (an older "
                     f"muoneq?), which this demo would reuse; delete it (rm -r {study_dir}) or "
                     "pass --runs-dir OTHER_FOLDER")
    assert "--set study=NAME" in details[0] and "overrides" in details[0]


def test_what_the_demo_says_to_run_next_runs_as_printed(tmp_path, monkeypatch):
    """Its commands run from the folder it ran in, whether or not the environment is activated
    (a new user's PATH lacks .venv/bin)."""
    from muoneq.suite.cli import program
    from muoneq.suite.demo import next_steps
    from tests.helpers.commands import clean_env
    from tests.helpers.sweeps import options, write_sweep

    bin_dir = str(Path(sys.executable).parent)
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir)
    monkeypatch.setenv("PATH", bare)
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", seeds=[0]))
    runs = tmp_path / "runs"
    assert Driver(spec, options(tmp_path)).run().done == 2
    rows = next_steps(runs / "tiny", runs)
    assert rows[0][0] == str(runs / "tiny" / "report" / "report.md")
    shortened = {1: " --inspect", 2: "", 3: " --dry-run --set seeds=[0]"}  # no server, no runs
    out = {}
    for i, extra in shortened.items():
        command = rows[i][0]
        assert shlex.split(command)[0] != "muoneq" or shutil.which("muoneq"), command
        done = subprocess.run(command + extra, shell=True, capture_output=True, text=True,
                              env=clean_env(PATH=bare), timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        out[i] = done.stdout
    assert out[2].startswith("study tiny (journal:") and "2/2 runs done" in out[2]
    # TensorBoard's runs by their short names (the study's view), not their run folders
    view = runs / "tiny" / "tensorboard"
    assert sorted(re.findall(r"^Event statistics for (.*):$", out[1], re.MULTILINE)) == [
        str(view / name) for name in ("hparams", "muon_nes/seed0",
                                      "muoneq_nes/seed0")]
    # in an activated environment, the bare names
    monkeypatch.setenv("PATH", os.pathsep.join([bin_dir, bare]))
    if (Path(bin_dir) / "muoneq").is_file():
        assert program() == "muoneq"
