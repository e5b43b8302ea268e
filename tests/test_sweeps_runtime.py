"""A 2-trial grid through the real ``muoneq train`` (ResNet-18 on tiny CIFAR-format data),
then its report: the sweep driver and the runtime agree on the trial contract."""

from __future__ import annotations

import json

import pytest
import yaml
from runtime_helpers import tiny_cifar10

from muoneq.report import load_study_data, write_report
from muoneq.sweeps import Driver, DriverOptions, load_sweep

pytest.importorskip("muoneq.runtime.run")


@pytest.mark.slow
@pytest.mark.distributed
def test_grid_of_real_training_runs(tmp_path):
    sweep = {
        "study": "cifar-mini",
        "experiment": "cifar10_resnet18",
        "overrides": [*tiny_cifar10(tmp_path), "trainer.max_epochs=1"],
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
    report = write_report(data)
    table = (report.out_dir / "table_ablation.md").read_text()
    assert "| Muon-Nes | 0.05 |" in table and "| MuonEq-Nes | 0.05 |" in table
    assert (report.out_dir / "curve_val_acc.png").exists()
