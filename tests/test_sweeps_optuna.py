"""Every trial carries its point as Optuna params (muoneq.suite.sweeps.distributions), so Optuna's
own tools read every study: grids grown by bracketing, coordinate descent and TPE; the report adds
Optuna's importances, contour and slice plots, also for a study made before trials had params.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from muoneq.suite.report import load_study_data, write_report
from muoneq.suite.sweeps import Driver, load_sweep
from muoneq.suite.sweeps.distributions import merge, spec_distributions
from muoneq.suite.sweeps.spec import spec_from_dict
from muoneq.suite.sweeps.trial_record import TrialRecord
from tests.helpers.report import add_trial, stored_study
from tests.helpers.sweeps import load, options, write_sweep

matplotlib.use("Agg")

#: lr × momentum around the objective program's optimum (lr 0.3, momentum 0.8): bracketing
#: must add lr values above the grid, so the study's lr distribution must hold them from the start
TWO_AXES = [{"optimizer": ["muon_nes"], "optimizer.lr": [0.05, 0.1],
             "optimizer.momentum": [0.75, 0.8, 0.85], "optimizer.ns_steps": [5]}]


def run(tmp_path: Path, **fields) -> optuna.Study:
    return run_seeds(tmp_path, **{"seeds": [0], **fields})


def run_seeds(tmp_path: Path, **fields) -> optuna.Study:
    tmp_path.mkdir(parents=True, exist_ok=True)
    sweep = write_sweep(tmp_path / "s.yaml", **fields)
    summary = Driver(load_sweep(sweep), options(tmp_path)).run()
    assert summary.exit_code == 0
    return load(tmp_path)


def assert_params_are_points(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert done
    for t in done:
        assert t.params == TrialRecord.of(t).point, t.number
    return done


def test_a_bracketed_grid_carries_its_points_as_params_in_fixed_distributions(tmp_path):
    study = run(tmp_path, grid=TWO_AXES,
                bracket={"axes": ["optimizer.lr"], "max_extensions": 3})
    done = assert_params_are_points(study)
    lrs = sorted({t.params["optimizer.lr"] for t in done})
    assert lrs == [0.05, 0.1, 0.2, 0.4, 0.8]  # grown by bracketing: 0.2, 0.4 (best), 0.8
    dists = {name: {repr(t.distributions[name]) for t in done} for name in done[0].params}
    assert all(len(d) == 1 for d in dists.values()), dists  # one distribution per axis
    d = done[0].distributions
    # the widest lr bracketing could reach: 0.1 · 2³ above, 0.05 / 2³ below
    assert d["optimizer.lr"] == FloatDistribution(0.00625, 0.8, log=True)
    assert d["optimizer.momentum"] == FloatDistribution(0.75, 0.85)  # not bracketed
    assert d["optimizer.ns_steps"] == IntDistribution(5, 5)
    assert d["optimizer"] == CategoricalDistribution(["muon_nes"])
    frame = study.trials_dataframe()
    assert {"params_optimizer.lr", "params_optimizer.momentum"} <= set(frame.columns)
    assert frame["params_optimizer.lr"].notna().sum() == len(done)
    from optuna.visualization import matplotlib as views

    views.plot_contour(study, params=["optimizer.lr", "optimizer.momentum"])
    views.plot_slice(study)
    importances = optuna.importance.get_param_importances(study)
    # momentum is 0.05 from its optimum per step, lr a factor of 2: momentum matters more
    assert importances["optimizer.momentum"] > importances["optimizer.lr"]
    views.plot_param_importances(study)


def test_coordinate_descent_and_tpe_trials_carry_params(tmp_path):
    coordinate = {"type": "coordinate", "start": {"optimizer.lr": 0.1, "optimizer.momentum": 0.7},
                  "params": {"optimizer.lr": {"values": [0.1, 0.3]},
                             "optimizer.momentum": {"values": [0.7, 0.8]}}}
    study = run(tmp_path / "cd", grid=[], search=coordinate)
    done = assert_params_are_points(study)
    assert {t.params["optimizer.lr"] for t in done} == {0.1, 0.3}
    assert isinstance(done[0].distributions["optimizer.lr"], FloatDistribution)
    tpe = {"type": "tpe", "n_trials": 3, "sampler_seed": 0, "n_startup_trials": 2,
           "params": {"optimizer.lr": {"type": "float", "low": 0.01, "high": 1.0, "log": True}}}
    study = run(tmp_path / "tpe", grid=[], search=tpe)
    assert len(assert_params_are_points(study)) == 3


def test_distributions_cover_bracketing_and_only_widen():
    spec = spec_from_dict({
        "study": "d", "experiment": "e", "objective": {"metric": "m"},
        "grid": [{"optimizer": ["a", "b"], "optimizer.lr": [0.01, 0.02, 0.04],
                  "optimizer.ns_steps": [4, 5]}],
        "bracket": {"axes": ["optimizer.lr", "optimizer.ns_steps"], "max_extensions": 2,
                    "bounds": {"optimizer.ns_steps": [1, 6]}}})
    d = spec_distributions(spec)
    lr = d["optimizer.lr"]
    assert lr.log and math.isclose(lr.low, 0.0025) and math.isclose(lr.high, 0.16)
    assert d["optimizer.ns_steps"] == IntDistribution(2, 6)  # 4 − 2·1 … 5 + 1 (bound 6)
    assert d["optimizer"] == CategoricalDistribution(["a", "b"])
    wider = {"optimizer.lr": FloatDistribution(0.001, 0.01, log=True),
             "optimizer": CategoricalDistribution(["a", "b", "c"])}
    merged = merge(d, wider)
    assert merged["optimizer.lr"] == FloatDistribution(0.001, 0.16, log=True)
    assert merged["optimizer"] == d["optimizer"]  # a categorical's choices never change


def test_report_adds_optuna_views_also_for_a_study_without_params(tmp_path):
    """A study made before trials carried params (points in user attributes only) reports
    Optuna's importances, contour and slice plots from its points (10: enough for importances
    of its top 5)."""
    sweep = {"study": "old", "experiment": "cifar10_resnet18", "seeds": [0],
             "grid": [{"optimizer": ["muon_nes"],
                       "optimizer.lr": [0.005, 0.01, 0.02, 0.04, 0.08],
                       "optimizer.momentum": [0.9, 0.95]}],
             "objective": {"metric": "test_acc", "direction": "maximize"}}
    _, spec, study = stored_study(tmp_path, sweep)
    study_dir = tmp_path / "runs" / "old"
    for p in spec.points():
        point = p.as_dict()
        value = 0.9 - abs(math.log2(point["optimizer.lr"] / 0.02)) / 10 - (
            0.95 - point["optimizer.momentum"])
        add_trial(study, (point, p.key), 0, value)
    assert all(not t.params for t in study.get_trials())
    report = write_report(load_study_data(study_dir))
    for name in ("optuna_contour", "optuna_slice", "optuna_importances"):
        assert (report.out_dir / f"{name}.png").is_file()
        assert f"![{name}]({name}.png)" in report.markdown
    events = EventAccumulator(str(report.out_dir / "tensorboard"))
    events.Reload()
    # a figure of several panels is one image per panel (legible on TensorBoard's card)
    assert {"optuna/contour", "optuna/slice/lr", "optuna/slice/momentum",
            "optuna/importances"} <= set(events.Tags()["images"])
    assert "| optimizer | top points | lr | momentum |" in report.markdown
    assert "| all runs | 5 of 10 | " in report.markdown  # one optimizer: all points one family


def test_report_of_a_one_axis_study_has_no_optuna_views(tmp_path):
    study = run(tmp_path, grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.1, 0.3]}])
    assert_params_are_points(study)
    report = write_report(load_study_data(tmp_path / "runs" / "tiny"), tensorboard=False)
    assert "Optuna's views" not in report.markdown


def test_a_categorical_value_added_later_stays_out_of_params(tmp_path, caplog):
    """An optimizer added to the grid of a running study cannot join its recorded categorical
    (Optuna forbids new choices): its trials run, without that param, and the driver says so."""
    run(tmp_path, grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.3]}])
    study = run(tmp_path, grid=[{"optimizer": ["muon_nes", "adamw"], "optimizer.lr": [0.3]}])
    added = [t for t in study.get_trials(states=(TrialState.COMPLETE,))
             if TrialRecord.of(t).point["optimizer"] == "adamw"]
    assert len(added) == 1 and added[0].params == {"optimizer.lr": 0.3}
    assert "optimizer=adamw is not in the study's Optuna distribution" in caplog.text


def test_optuna_s_own_tools_read_a_grid_study_from_its_journal(tmp_path, caplog):
    """Loaded as a user would (Optuna's JournalStorage on the file), a grid of two seeds per
    point names its objective, records the best mean over seeds, and trials_dataframe() has a
    scalar seed column and the objective and the report's metrics as columns."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    caplog.set_level("INFO", logger="muoneq.suite.sweeps")
    run_seeds(tmp_path, seeds=[0, 1],
              grid=[{"optimizer": ["muon_nes"], "optimizer.lr": [0.1, 0.3, 0.6]}])
    # the log says each value to 4 significant digits: log2(0.1 / 0.3)² = 2.51211…
    assert "(optimizer=muon_nes optimizer.lr=0.1 | seed=0): val_loss = 2.512\n" in caplog.text
    journal = tmp_path / "runs" / "tiny" / "optuna.journal"
    study = optuna.load_study(study_name="tiny",
                              storage=JournalStorage(JournalFileBackend(str(journal))))
    assert study.metric_names == ["val_loss"]
    trials = {(t.params["optimizer.lr"], t.user_attrs["seed"]): t for t in study.trials}
    assert len(trials) == 6
    # the program's objective: log2(lr / 0.3)² + 0.001·seed; best mean: lr 0.3, (0 + 0.001) / 2
    assert study.user_attrs["best_mean"] == {
        "point": {"optimizer": "muon_nes", "optimizer.lr": 0.3},
        "key": "optimizer=muon_nes optimizer.lr=0.3", "val_loss": pytest.approx(0.0005),
        "seeds": [0, 1], "trials": [trials[0.3, 0].number, trials[0.3, 1].number]}
    assert study.best_trial.number == trials[0.3, 0].number  # Optuna's: one seed, the luckiest
    frame = study.trials_dataframe()
    assert frame["user_attrs_seed"].tolist() == [trials[k].user_attrs["seed"] for k in
                                                 sorted(trials, key=lambda k: trials[k].number)]
    assert frame["user_attrs_seed"].dtype.kind == "i"
    assert (frame["user_attrs_val_loss"] == frame["value_val_loss"]).all()  # named


def demo_like(tmp_path: Path, seeds=(0, 1)):
    """A demo-like study in storage: Muon-Nes, MuonEq-Nes R and C and AdamW, each over an lr
    grid inside one decade, AdamW ~6 worse; values ``base + log2(lr / best)² + 0.1·seed``."""
    from muoneq.suite.report.tables import setting_label

    sweep = {"study": "demo-like", "experiment": "llama_tiny_shakespeare", "seeds": list(seeds),
             "grid": [{"optimizer": ["muon_nes"], "optimizer.lr": [0.02, 0.04, 0.08]},
                      {"optimizer": ["muoneq_nes"], "optimizer.mode": ["R", "C"],
                       "optimizer.lr": [0.02, 0.04, 0.08]},
                      {"optimizer": ["adamw"], "optimizer.lr": [0.001, 0.003, 0.01]}],
             "objective": {"metric": "val/ppl", "direction": "minimize"}}
    _, spec, study = stored_study(tmp_path, sweep)
    base = {"Muon-Nes": 6.2, "MuonEq-Nes (R)": 5.7, "MuonEq-Nes (C)": 6.1, "AdamW": 12.7}
    means = {}
    for p in spec.points():
        point = p.as_dict()
        best = 0.003 if point["optimizer"] == "adamw" else 0.04
        mean = base[setting_label(point).split(" | ")[0]] + math.log2(
            point["optimizer.lr"] / best) ** 2
        for seed in seeds:
            add_trial(study, (point, p.key), seed, mean + 0.1 * seed,
                      metrics={"val/ppl": mean + 0.1 * seed})
        means[p.key] = mean + 0.1 * statistics.fmean(seeds)
    return load_study_data(tmp_path / "runs" / "demo-like"), means


def test_optuna_views_per_optimizer_from_point_means_with_every_axis_labelled(tmp_path):
    """A slice plot per optimizer (the mode as categories), no contour (one numeric axis; none
    across optimizers or modes), no importances (too few points per optimizer); each point is
    its mean over seeds, and an lr grid inside one decade is labelled at its values."""
    from optuna.visualization import matplotlib as views

    from muoneq.suite.report import optuna_views

    data, means = demo_like(tmp_path)
    report = write_report(data, tensorboard=False)
    files = sorted(p.name for p in report.out_dir.glob("optuna_*.png"))
    assert files == ["optuna_slice_AdamW.png", "optuna_slice_Muon-Nes.png",
                     "optuna_slice_MuonEq-Nes.png"]
    assert ("No importances for Muon-Nes (3 points), MuonEq-Nes (6 points), AdamW (3 points)"
            in report.markdown)
    points, varying, _ = optuna_views.point_means(data)
    assert varying == ["optimizer", "optimizer.lr", "optimizer.mode"]
    assert sorted(p.mean for p in points) == pytest.approx(sorted(means.values()))
    (muoneq,) = [f for f in optuna_views.optimizer_families(data, points, varying)
                 if f.label == "MuonEq-Nes"]
    assert muoneq.axes == ["optimizer.lr", "optimizer.mode"]
    fig = views.plot_slice(optuna_views.point_study(muoneq.points, muoneq.axes, data),
                           params=muoneq.axes)[0].figure
    optuna_views._label_axes(fig, muoneq.points)
    lr, mode = fig.axes[:2]
    assert [t.get_text() for t in lr.get_xticklabels()] == ["0.02", "0.04", "0.08"]
    assert lr.get_xscale() == "log" and lr.get_xlabel() == "lr"
    assert sorted(t.get_text() for t in mode.get_xticklabels()) == ["C", "R"]
    assert sorted(lr.collections[0].get_offsets()[:, 1]) == pytest.approx(sorted(
        means[k] for k in means if k.startswith("optimizer=muoneq_nes")))


def test_an_integer_axis_is_labelled_as_integers():
    """K in a contour: ticks 4 and 5, not 4.0, 4.2, …"""
    from optuna.visualization import matplotlib as views

    from muoneq.suite.report import optuna_views
    from muoneq.suite.report.records import StudyData

    points = [optuna_views.PointMean({"optimizer.lr": lr, "optimizer.ns_steps": k}, lr * k)
              for lr in (0.01, 0.02, 0.04) for k in (4, 5)]
    spec = spec_from_dict({"study": "k", "experiment": "e", "objective": {"metric": "m"},
                           "grid": [{"optimizer.lr": [0.01, 0.02, 0.04],
                                     "optimizer.ns_steps": [4, 5]}]})
    data = StudyData(spec, Path("."), [])
    study = optuna_views.point_study(points, ["optimizer.lr", "optimizer.ns_steps"], data)
    fig = views.plot_contour(study, params=["optimizer.lr", "optimizer.ns_steps"]).figure
    optuna_views._label_axes(fig, points)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["4", "5"] and ax.get_ylabel() == "K"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.01", "0.02", "0.04"]


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_slice_colours_each_point_by_its_method_in_a_search_s_trial_order(tmp_path):
    """A TPE study meets the modes out of category order (C, R, RC, R, C): Optuna draws a
    categorical panel's dots by category, and each must keep its own method's colour; the lr
    values of a search (arbitrary floats) get short labels that do not overlap."""
    from muoneq.suite.report import optuna_views
    from muoneq.suite.report.figures import Palette
    from muoneq.suite.report.records import StudyData

    spec = spec_from_dict({"study": "t", "experiment": "e", "objective": {"metric": "m"},
                           "grid": [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.01],
                                     "optimizer.mode": ["R", "C", "RC"]}]})
    data = StudyData(spec, tmp_path, [])
    modes = ["C", "R", "RC", "R", "C", "RC", "R", "C"]
    lrs = [0.0123456789 * 1.37 ** i for i in range(len(modes))]
    points = [optuna_views.PointMean({"optimizer": "muoneq_nes", "optimizer.lr": lr,
                                      "optimizer.mode": mode}, 5.0 + i)
              for i, (lr, mode) in enumerate(zip(lrs, modes, strict=True))]
    family = optuna_views.Family("MuonEq-Nes", points, ["optimizer.lr", "optimizer.mode"], {}, 0)
    palette = Palette()
    plots = optuna_views._plots(data, points, ["optimizer.lr", "optimizer.mode"], [family], "m")
    draw, group, axes, _, _ = plots["optuna_slice"]
    fig = draw()[0].figure  # as write_views draws it
    optuna_views._make_room(fig, "slice", len(axes))
    optuna_views._label_axes(fig, group)
    optuna_views._method_colours(fig, group, palette)
    lr_ax, mode_ax = fig.axes[:2]
    (dots,) = [c for c in mode_ax.collections if len(c.get_offsets())]
    mean_mode = {p.mean: p.values["optimizer.mode"] for p in points}
    for (_, y), colour in zip(dots.get_offsets(), dots.get_facecolors(), strict=True):
        method = {"optimizer": "muoneq_nes", "optimizer.mode": mean_mode[y]}
        assert matplotlib.colors.to_hex(colour) == palette.colour(method), mean_mode[y]
    labels = [t.get_text() for t in lr_ax.get_xticklabels()]
    assert len(labels) <= optuna_views.MAX_LABELS and labels[0] == "0.012"
    assert all(len(label) <= 5 for label in labels), labels
    fig.savefig(tmp_path / "slice.png")
    matplotlib.pyplot.close(fig)
