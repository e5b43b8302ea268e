"""TensorBoard's HParams view of a study (muoneq.suite.sweeps.hparams), read back with TensorBoard's
own readers (EventAccumulator and the hparams plugin's metadata parsers): one experiment config
for the study (the axes, optimizer and mode; the objective and the report's metrics by their
names), one session per run grouped by its point, with its metrics.json values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.plugins.hparams import metadata

from muoneq.suite.sweeps import Driver, load_sweep
from muoneq.suite.sweeps.events import ScalarReader
from tests.helpers.sweeps import options, read, session, write_sweep


def experiment(study_dir: Path):
    content = read(study_dir / "hparams").PluginTagToContent(metadata.PLUGIN_NAME)
    return metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])


def test_a_two_axis_study_declares_its_axes_and_metrics_and_one_session_per_run(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0, 1], grid=[{
        "optimizer": ["muon_nes"], "optimizer.lr": [0.1, 0.3],
        "optimizer.momentum": [0.75, 0.8], "optimizer.ns_steps": [5]}],
        report={"tables": [{"name": "t", "metrics": [{"key": "val_loss"}]}]})
    assert Driver(load_sweep(sweep), options(tmp_path)).run().exit_code == 0
    study_dir = tmp_path / "runs" / "tiny"
    exp = experiment(study_dir)
    # the swept axes, the optimizer and its mode; K (one value: a constant) is left out
    assert [(h.name, h.differs) for h in exp.hparam_infos] == [
        ("optimizer.lr", True), ("optimizer.momentum", True), ("optimizer", False),
        ("optimizer.mode", False)]
    assert [(m.name.tag, m.display_name) for m in exp.metric_infos] == [("val_loss", "val_loss")]
    assert exp.metric_infos[0].description == "the study's objective (lower is better)"
    runs = sorted(study_dir.glob("trials/*/seed*"))
    assert len(runs) == 8
    # one TensorBoard run per run folder (its session beside its curves), and the study's config
    found = {p.parent.relative_to(study_dir) for p in study_dir.rglob("events.out.tfevents.*")}
    assert found == {Path("hparams"), *(r.relative_to(study_dir) / "tensorboard" for r in runs)}
    for run_dir in runs:
        group, hparams, scalars = session(run_dir)
        # its row: its swept values (its folder bears its whole point); its seeds share it
        lr, momentum = hparams["optimizer.lr"], hparams["optimizer.momentum"]
        assert run_dir.parent.name == (f"optimizer=muon_nes,optimizer.lr={lr:g},"
                                       f"optimizer.momentum={momentum:g},optimizer.ns_steps=5")
        assert group == f"lr={lr:g} momentum={momentum:g}"
        # K is an integer: text, since TensorBoard prints every number as 5.0000
        assert hparams["optimizer"] == "muon_nes" and hparams["optimizer.ns_steps"] == "5"
        # a value for every declared one (TensorBoard's parallel coordinates drop a row that
        # lacks one): no config.yaml here, so no mode
        assert {h.name for h in exp.hparam_infos} <= set(hparams)
        assert hparams["optimizer.mode"] == "n/a"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert set(scalars) == {"val_loss"}  # float32 in the event file
        assert scalars["val_loss"] == pytest.approx(metrics["val_loss"], rel=1e-6, abs=1e-9)
        assert ScalarReader(run_dir).tags() == []  # a session is no learning curve
