"""TensorBoard's HParams view of a study (muoneq.suite.sweeps.hparams), read back with TensorBoard's
own readers (EventAccumulator and the hparams plugin's metadata parsers): one experiment config
for the study (the axes, optimizer and mode; the objective and the report's metrics by their
names), one session per run grouped by its point, with its metrics.json values; the study's
view of its runs by short names (muoneq.suite.sweeps.tensorboard_view), as TensorBoard's own
loader and HParams plugin list them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tensorboard.plugins.hparams import metadata

from muoneq.suite.sweeps import Driver, load_sweep
from muoneq.suite.sweeps.events import ScalarReader
from muoneq.suite.sweeps.spec import Point
from muoneq.suite.sweeps.tensorboard_view import short_names, write_view
from tests.helpers.sweeps import options, read, session, tensorboard_view, write_sweep


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


def test_tensorboard_names_each_run_by_the_axes_that_differ_and_its_seed(tmp_path):
    """``tensorboard --logdir runs/<study>/tensorboard``, read by TensorBoard's own loader and
    HParams plugin: every run once, by a short name holding only what tells it apart (the full
    folder names share their first 40 characters); its session pairs with it; re-running the
    sweep keeps the names."""
    sweep = write_sweep(tmp_path / "s.yaml", seeds=[0, 1], grid=[
        {"optimizer": ["muon_nes"], "optimizer.lr": [0.1, 0.3], "optimizer.momentum": [0.75],
         "optimizer.ns_steps": [5]},
        {"optimizer": ["muoneq_nes"], "optimizer.mode": ["R", "RC"], "optimizer.lr": [0.1],
         "optimizer.momentum": [0.75]}])
    assert Driver(load_sweep(sweep), options(tmp_path, workers=2)).run().exit_code == 0
    study_dir = tmp_path / "runs" / "tiny"
    points = ["muon_nes,lr=0.1", "muon_nes,lr=0.3",
              "muoneq_nes,lr=0.1,mode=R", "muoneq_nes,lr=0.1,mode=RC"]
    names = {f"{p}/seed{s}" for p in points for s in (0, 1)}
    runs, sessions = tensorboard_view(study_dir / "tensorboard")
    assert runs == sorted({"hparams", *names})  # the report's link leads nowhere yet
    assert set(sessions) == names
    for name, metrics in sessions.items():  # each its own run's, from its metrics.json
        run_dir = (study_dir / "tensorboard" / name).resolve().parent
        assert run_dir.parent.parent == (study_dir / "trials").resolve()
        assert metrics["val_loss"] == pytest.approx(
            json.loads((run_dir / "metrics.json").read_text())["val_loss"], rel=1e-6)
    view = sorted(p.relative_to(study_dir) for p in (study_dir / "tensorboard").rglob("*"))
    assert Driver(load_sweep(sweep), options(tmp_path)).run().exit_code == 0  # nothing to do
    assert sorted(p.relative_to(study_dir) for p in (study_dir / "tensorboard").rglob("*")) \
        == view
    assert tensorboard_view(study_dir / "tensorboard") == (runs, sessions)


@pytest.mark.parametrize(("values", "expected"), [
    # the axes that differ, numbers to 4 significant digits
    ([{"optimizer": "muon_nes", "optimizer.lr": 0.0123456, "optimizer.ns_steps": 5},
      {"optimizer": "muon_nes", "optimizer.lr": 2e-05, "optimizer.ns_steps": 5}],
     ["lr=0.01235", "lr=2e-05"]),
    # names that would coincide keep their folders' names
    ([{"optimizer.lr": 0.0123451}, {"optimizer.lr": 0.0123452}, {"optimizer.lr": 0.5}],
     ["optimizer.lr=0.0123451", "optimizer.lr=0.0123452", "lr=0.5"]),
    # a name the view's own entries have keeps its folder's name
    ([{"optimizer": "report"}, {"optimizer": "sgd"}], ["optimizer=report", "sgd"]),
    # one point: its every axis
    ([{"optimizer": "adamw", "trainer.max_steps": 100}],
     ["adamw,trainer.max_steps=100"]),
])
def test_short_names_keep_what_tells_points_apart(values, expected):
    points = [Point(tuple(v.items())) for v in values]
    assert [short_names(points)[p.key] for p in points] == expected


def test_the_view_removes_only_its_own_stale_links(tmp_path, caplog):
    """A rewritten view drops links of points gone (and the folders that leaves empty), replaces
    a link that leads elsewhere, keeps a file of someone's; a view folder that is a link is left
    alone."""
    study_dir = tmp_path / "study"
    point = Point((("optimizer.lr", 0.1),))
    runs = {point.run_dir(Path(), 0): (point, 0)}
    view = study_dir / "tensorboard"
    (view / "old").mkdir(parents=True)
    (view / "old" / "seed0").symlink_to("../../trials/old/seed0/tensorboard")
    (view / "notes.txt").write_text("mine")
    (view / "hparams").symlink_to("elsewhere")
    write_view(study_dir, runs)
    found = {p.relative_to(view): os.readlink(p) if p.is_symlink() else p.read_text()
             for p in view.rglob("*") if not p.is_dir() or p.is_symlink()}
    assert found == {Path("notes.txt"): "mine", Path("hparams"): "../hparams",
                     Path("report"): "../report/tensorboard",
                     Path("lr=0.1/seed0"): "../../trials/optimizer.lr=0.1/seed0/tensorboard"}
    assert not (view / "old").exists()
    other = tmp_path / "other"
    other.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tensorboard").symlink_to(other, target_is_directory=True)
    write_view(linked, runs)
    assert not any(other.iterdir()) and "is not a folder the sweep made" in caplog.text
