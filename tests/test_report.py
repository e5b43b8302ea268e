"""Reports against hand-computed numbers: tables (Markdown, LaTeX), heatmaps, lines, curves,
and a study read back from its Optuna storage."""

from __future__ import annotations

import csv
import io
import itertools
import os

import numpy as np
import pytest
from matplotlib.image import imread
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

from muoneq.suite.report import load_study_data, write_report
from muoneq.suite.report.cli import main as report_main
from muoneq.suite.report.figures import (
    Palette,
    heatmaps,
    learning_curves,
    line_plot,
    number_format,
    robustness_markdown,
)
from muoneq.suite.report.tables import build_table, to_latex, to_markdown
from muoneq.suite.sweeps.report_spec import (
    CurveSpec,
    HeatmapSpec,
    LineSpec,
    MetricColumn,
    TableSpec,
)
from tests.helpers.report import add_trial, stored_study

NAN = float("nan")


def runs_of(rows: list[tuple[dict, list[float]]], metric: str, **extra) -> list[dict]:
    """One record per seed, as muoneq.suite.report.records builds them."""
    out = []
    for point, values in rows:
        for seed, v in enumerate(values):
            status = "complete" if v == v else "diverged"
            metrics = {metric: v, **{k: f(point, seed) for k, f in extra.items()}}
            out.append({**point, "seed": seed, **metrics, "_status": status,
                        "_run_dir": f"/nowhere/{len(out)}", "_trial": len(out)})
    return out


def opt(name, lr, mode=None, **kw):
    return {"optimizer": name, "optimizer.lr": lr, "optimizer.mode": mode, **kw}


ABLATION = [  # test accuracy per seed
    (opt("sgd", 0.1), [0.90, 0.92, 0.94]),  # mean 0.92
    (opt("sgd", 0.05), [0.93, 0.95, 0.94]),  # mean 0.94 ± 0.01  ← best, grid edge
    (opt("sgd", 0.01), [0.80, 0.81, 0.82]),
    (opt("muon_nes", 0.1), [0.90, 0.90, 0.90]),
    (opt("muon_nes", 0.05), [0.944, 0.945, 0.946]),  # mean 0.945 ± 0.001  ← best
    (opt("muon_nes", 0.01), [0.93, 0.93, 0.93]),
    (opt("muoneq_nes", 0.05, "R"), [0.95, 0.96, 0.94]),  # 0.95 ± 0.01 ← best overall
    (opt("muoneq_nes", 0.05, "C"), [0.96, 0.97, NAN]),  # one seed diverged: not eligible
    (opt("muoneq_nes", 0.01, "C"), [0.91, 0.92, 0.93]),  # 0.92 ± 0.01  ← C's best, an edge
    (opt("muoneq_nes", 0.1, "C"), [0.50, 0.50, 0.50]),
]
AXES = ["optimizer", "optimizer.lr", "optimizer.mode"]


def ablation_table(**spec):
    runs = runs_of(ABLATION, "test_acc")
    points = [p for p, _ in ABLATION]
    tspec = TableSpec(name="ablation", metrics=[MetricColumn(key="test_acc", label="Acc. (%)",
                                                             scale=100)], **spec)
    return build_table(runs, tspec, AXES, "test_acc", "maximize", points)


def test_ablation_table_markdown_matches_hand_computed_means_and_stds():
    md = to_markdown(ablation_table())
    lines = md.splitlines()
    assert lines[0] == "| Method | lr | Acc. (%) |"
    assert lines[2:6] == [
        "| SGD | 0.05 | 94.00 ± 1.00 |",
        "| Muon-Nes | 0.05 | 94.50 ± 0.10 |",
        "| MuonEq-Nes (R) | 0.05 | **95.00 ± 1.00** (+0.50) |",
        "| MuonEq-Nes (C) | 0.01 | 92.00 ± 1.00 (-2.50) |",
    ]
    assert "sample std" in md
    notes = [line for line in lines if line.startswith("- note:")]
    assert len(notes) == 1 and "MuonEq-Nes (C)" in notes[0] and "edge" in notes[0]


def test_edge_of_grid_note_on_two_point_grids():
    rows = [(opt("sgd", 0.1), [0.90]), (opt("sgd", 0.05), [0.93])]
    table = build_table(runs_of(rows, "acc"), TableSpec(name="t"), AXES, "acc", "maximize",
                        [p for p, _ in rows])
    assert table.notes == ["SGD: best lr=0.05 is at the edge of its grid ['0.05', '0.1']; "
                           "extend the grid"]


def test_ablation_table_latex():
    tex = to_latex(ablation_table())
    assert r"\begin{tabular}{lcc}" in tex and r"\toprule" in tex and r"\bottomrule" in tex
    assert r"MuonEq-Nes (R) & 0.05 & $\mathbf{95.00}_{\pm1.00}$\,{\scriptsize(+0.50)} \\" in tex
    assert r"SGD & 0.05 & $94.00_{\pm1.00}$ \\" in tex
    assert r"Acc. (\%)" in tex


def test_table_with_column_groups_memory_and_time():
    rows = []
    for exp, base in (("130m", 20.0), ("350m", 15.0)):
        rows += [
            (opt("muon", 3e-3, experiment=exp), [base + 0.5]),
            (opt("muon", 5e-3, experiment=exp), [base + 0.9]),
            (opt("muoneq", 3e-3, experiment=exp), [base + 0.2]),
            (opt("muoneq", 5e-3, experiment=exp), [base - 0.1]),
        ]
    runs = runs_of(rows, "val_ppl",
                   peak_mem_gb=lambda p, s: 12.5 if p["experiment"] == "130m" else 28.2,
                   step_time_s=lambda p, s: 0.25 + (p["optimizer"] == "muoneq") * 0.01)
    for r in runs:
        del r["optimizer.mode"]
    spec = TableSpec(name="compare", columns="experiment", metrics=[
        MetricColumn(key="val_ppl", label="ppl"), MetricColumn(key="peak_mem_gb", label="mem"),
        MetricColumn(key="step_time_s", label="s/step")])
    axes = ["experiment", "optimizer", "optimizer.lr"]
    table = build_table(runs, spec, axes, "val_ppl", "minimize", [p for p, _ in rows])
    md = to_markdown(table).splitlines()
    assert md[0] == ("| Method | 130m · lr | 130m · ppl | 130m · mem | 130m · s/step | "
                     "350m · lr | 350m · ppl | 350m · mem | 350m · s/step |")
    assert md[2] == ("| Muon | 0.003 | 20.50 | **12.50** | **0.25** | 0.003 | 15.50 | **28.20** | "
                     "**0.25** |")
    assert md[3] == ("| MuonEq | 0.005 | **19.90** (-0.60) | **12.50** | 0.26 | 0.005 | "
                     "**14.90** (-0.60) | **28.20** | 0.26 |")
    tex = to_latex(table)
    assert r"\multicolumn{4}{c}{130m} & \multicolumn{4}{c}{350m}" in tex
    assert r"\cmidrule(lr){2-5} \cmidrule(lr){6-9}" in tex


def test_heatmaps_have_the_grid_axes_a_shared_scale_and_robustness(tmp_path):
    rows, ppl = [], {}
    for name, offset in (("muon_nes", 1.0), ("muoneq_nes", 0.0)):
        for lr in (1e-3, 2e-3, 5e-3):
            for mom in (0.9, 0.95):
                ppl[name, lr, mom] = 25.0 + offset + (lr == 5e-3) * 3 + (mom == 0.9) * 0.5
                mode = "R" if name == "muoneq_nes" else None
                rows.append((opt(name, lr, mode, **{"optimizer.momentum": mom,
                                                   "optimizer.ns_steps": 5}),
                             [ppl[name, lr, mom] - 0.1, ppl[name, lr, mom] + 0.1]))
    axes = [*AXES, "optimizer.momentum", "optimizer.ns_steps"]
    spec = HeatmapSpec(x="optimizer.lr", y="optimizer.momentum", robustness_pct=3.0)
    panels = heatmaps(runs_of(rows, "val_ppl"), spec, axes, "val_ppl", "minimize", tmp_path)
    assert [p.title for p in panels] == ["Muon-Nes | K=5", "MuonEq-Nes (R) | K=5"]
    # one figure as the paper's Figure 8: a panel per optimizer side by side, one colour bar
    (fig,) = {id(p.figure): p.figure for p in panels}.values()
    assert {p.path for p in panels} == {tmp_path / "heatmaps.png"}
    assert [ax for ax in fig.axes if ax.get_visible() and ax.images] == [p.ax for p in panels]
    assert [p.ax.get_subplotspec().colspan.start for p in panels] == [0, 1]
    (bar,) = [ax for ax in fig.axes if ax.get_ylabel() == "val_ppl (lower is better)"]
    assert "lower is better" in fig.get_suptitle()
    for p in panels:
        ax = p.ax
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.001", "0.002", "0.005"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0.9", "0.95"]
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("lr", "momentum")
        assert ax.images[0].get_clim() == (25.0, 29.5)  # one color scale for every panel
        # one colour map whatever the direction, which the title and the colour bar say
        assert ax.images[0].get_cmap().name == "viridis"
        assert ax.get_title() == p.title
        texts = [t.get_text() for t in ax.texts]  # one number format in the figure
        assert all(len(t.split(".")[1]) == 1 for t in texts)  # 26.0 beside 26.5, not 26
        assert ("26.0" if p.title.startswith("Muon-Nes") else "25.0") in texts
        framed = {p.grid[round(f.get_y() + 0.5), round(f.get_x() + 0.5)] for f in ax.patches}
        assert framed == {p.best}  # the panel's best cells (two, tied) are framed
        assert len(ax.patches) == 2
        name = "muon_nes" if p.title.startswith("Muon-Nes") else "muoneq_nes"
        for i, mom in enumerate((0.9, 0.95)):
            for j, lr in enumerate((1e-3, 2e-3, 5e-3)):
                assert p.grid[i, j] == pytest.approx(ppl[name, lr, mom])
        assert imread(p.path).shape[0] > 100
        with p.csv.open() as fh:
            assert next(csv.reader(fh)) == ["momentum \\ lr", "0.001", "0.002", "0.005"]
    # best cell 25.0; within 3%: ≤ 25.75 → MuonEq: 25.0, 25.0, 25.5, 25.5 (4/6); Muon: 26 > 25.75
    assert [p.robustness for p in panels] == [0.0, pytest.approx(4 / 6)]
    # each panel's own best: Muon 26.0 (≤ 26.78: 26, 26, 26.5, 26.5 → 4/6), MuonEq 25.0 (4/6)
    assert [p.best for p in panels] == [26.0, 25.0]
    assert [p.robustness_own for p in panels] == [pytest.approx(4 / 6)] * 2
    assert (tmp_path / "robustness.png").exists()
    md = robustness_markdown(panels, spec, "val_ppl", "minimize").splitlines()
    assert md[0] == ("| panel | best val_ppl | cells within 3% of the best of all panels (25) | "
                     "cells within 3% of the panel's own best |")
    assert md[2:] == ["| Muon-Nes \\| K=5 | 26 | 0% (0/6) | 67% (4/6) |",
                      "| MuonEq-Nes (R) \\| K=5 | 25 | 67% (4/6) | 67% (4/6) |"]


def test_k_sweep_lines_pick_the_best_lr_per_k(tmp_path):
    rows = []
    for k in (1, 3, 5):
        rows.append((opt("muon_nes", 1e-3, **{"optimizer.ns_steps": k}), [30.0 - k, 32.0 - k]))
        rows.append((opt("muon_nes", 2e-3, **{"optimizer.ns_steps": k}), [40.0, 40.0]))
    runs = runs_of(rows, "val_ppl", step_time_s=lambda p, s: 0.1 * p["optimizer.ns_steps"])
    spec = LineSpec(name="ksweep", x="optimizer.ns_steps", metrics=["val_ppl", "step_time_s"],
                    select=["optimizer.lr"])
    series, path = line_plot(runs, spec, [*AXES, "optimizer.ns_steps"], "val_ppl", "minimize",
                             tmp_path)
    (s,) = series
    assert s.label == "Muon-Nes" and s.x == [1, 3, 5]
    assert s.mean["val_ppl"] == [30.0, 28.0, 26.0]
    assert s.std["val_ppl"] == pytest.approx([2 ** 0.5] * 3)
    assert s.mean["step_time_s"] == pytest.approx([0.1, 0.3, 0.5])
    assert path.exists() and path.with_suffix(".csv").read_text().count("\n") == 4


def test_learning_curves_average_the_seeds_event_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    runs = []
    for seed, scale in enumerate((1.0, 3.0)):
        run_dir = tmp_path / f"seed{seed}"
        with SummaryWriter(str(run_dir / "tb")) as w:
            for step in (10, 20, 30):
                w.add_scalar("val_loss", scale * 100 / step, step)
                w.add_scalar("val_ppl", scale * 1e4 / step ** 2, step)
        runs.append({**opt("muoneq_nes", 0.02, "R"), "seed": seed, "val_loss": scale,
                     "_status": "complete", "_run_dir": str(run_dir), "_trial": seed})
    out = learning_curves(runs, CurveSpec(tags=["val_loss", "absent", "val_ppl"]), AXES,
                          "val_loss", "minimize", tmp_path)
    assert list(out) == ["val_loss", "val_ppl"]
    # a curve spanning more than 10x (a perplexity from its first validation on) is on a log
    # axis, where close curves stay apart; one within 10x keeps a linear one
    ppl_axis = out["val_ppl"].figure.axes[0]
    assert (ppl_axis.get_yscale(), ppl_axis.get_ylabel()) == ("log", "val_ppl (log scale)")
    plot = out["val_loss"]
    curve = plot.curves["MuonEq-Nes (R) (lr=0.02)"]
    assert curve.steps == [10, 20, 30] and curve.seeds == 2
    assert curve.mean == pytest.approx([20.0, 10.0, 20 / 3])
    assert curve.low == pytest.approx([10.0, 5.0, 10 / 3])  # the min–max band of the seeds
    assert curve.high == pytest.approx([30.0, 15.0, 10.0])
    assert imread(plot.path).shape[0] > 100
    ax = plot.figure.axes[0]  # the figure says what it averages, and over how many seeds
    assert ax.get_title() == "val_loss: mean over 2 seeds, band: min–max"
    assert (ax.get_yscale(), ax.get_ylabel()) == ("linear", "val_loss")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "MuonEq-Nes (R) (lr=0.02), 2 seeds"]
    assert len(ax.collections) == 1  # the band
    # the right panel: the last half of the steps on a scale of its own, where methods differ
    zoom = plot.figure.axes[1]
    assert zoom.get_xlim()[0] == 20 and zoom.get_title() == "the last 50% of the steps"
    assert zoom.get_ylim()[0] < 10 / 3 and 15 < zoom.get_ylim()[1] < 16


def test_a_missing_curve_says_why(tmp_path):
    """Runs shorter than trainer.log_every_n_steps log no training scalar: the report says so,
    with the override that fixes it; otherwise it lists what the run did log."""
    from types import SimpleNamespace

    from torch.utils.tensorboard import SummaryWriter

    from muoneq.suite.report.build import _why_no_curve

    run_dir = tmp_path / "run"
    with SummaryWriter(str(run_dir / "tensorboard")) as w:
        w.add_scalar("val/loss", 3.0, 15)
    (run_dir / "config.yaml").write_text("trainer: {log_every_n_steps: 25}\n"
                                         "provenance: {fingerprint: abc}\n")
    data = SimpleNamespace(runs=[{"_run_dir": str(run_dir), "global_step": 15}])
    assert _why_no_curve(data, "train/loss") == (
        ": its runs ran 15 steps, and a run logs its training scalars every "
        "trainer.log_every_n_steps=25 steps; run them with a smaller one (e.g. --override "
        "trainer.log_every_n_steps=1)")
    data.runs[0]["global_step"] = 40
    assert _why_no_curve(data, "train/los") == " (the first run logged: val/loss)"


def test_report_reads_the_study_from_storage_and_writes_every_file(tmp_path, capsys):
    sweep = {"study": "mini", "experiment": "cifar10_resnet18", "seeds": [0, 1],
             "grid": [{"optimizer": ["sgd", "muon_nes", "muoneq_nes"], "optimizer.lr": [0.05]}],
             "objective": {"metric": "test_acc", "direction": "maximize"},
             "report": {"tables": [{"name": "ablation",
                                    "metrics": [{"key": "test_acc", "scale": 100}]}]}}
    path, spec, study = stored_study(tmp_path, sweep)
    study_dir = tmp_path / "runs" / "mini"
    cells = [(p.as_dict(), p.key) for p in spec.points()]
    values = {0: (0.90, 0.92), 1: (0.94, 0.95), 2: (0.95, 0.97)}
    for i, (a, b) in values.items():
        add_trial(study, cells[i], 0, a)
        add_trial(study, cells[i], 1, b)
    add_trial(study, cells[0], 0, 0.99)  # a repeat of a finished run: ignored
    add_trial(study, cells[1], 0, None, state=TrialState.FAIL, outcome="failed")
    data = load_study_data(study_dir)
    assert len(data.runs) == 6 and data.duplicates == [6]
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert "| SGD | 0.05 | 91.00 ± 1.41 |" in out
    assert "| MuonEq-Nes | 0.05 | **96.00 ± 1.41** (+1.50) |" in out
    assert "trials [6] repeat a finished run" in out
    for name in ("table_ablation.md", "table_ablation.tex", "report.md"):
        assert (study_dir / "report" / name).exists()
    # The sweep file works as the target too (its report section is the one used).
    report = write_report(load_study_data(path, runs_dir=tmp_path / "runs"))
    assert (report.out_dir / "tensorboard").is_dir()
    assert [label for label, _, _ in report.tables[0].rows] == ["SGD", "Muon-Nes", "MuonEq-Nes"]


def test_a_report_gives_an_older_study_its_tensorboard_view(tmp_path, capsys):
    """A study made before views were: its report writes the view (the runs by short names,
    with the report's own images) and prints the command that reads it."""
    from tests.helpers.sweeps import tensorboard_view

    sweep = {"study": "old", "experiment": "cifar10_resnet18", "seeds": [0, 1],
             "grid": [{"optimizer": ["sgd", "muon_nes"], "optimizer.lr": [0.05]}],
             "objective": {"metric": "test_acc", "direction": "maximize"}}
    _, spec, study = stored_study(tmp_path, sweep)
    for i, p in enumerate(spec.points()):
        for seed in (0, 1):
            add_trial(study, (p.as_dict(), p.key), seed, 0.9 + 0.01 * i)
    study_dir = tmp_path / "runs" / "old"
    assert report_main([str(study_dir)]) == 0
    view = study_dir / "tensorboard"
    assert capsys.readouterr().out.splitlines()[-1].endswith(f" --logdir {view}")
    assert {str(p.relative_to(view)): os.readlink(p) for p in view.glob("*/seed*")} == {
        f"{name}/seed{seed}":
            f"../../trials/optimizer={name},optimizer.lr=0.05/seed{seed}/tensorboard"
        for name in ("sgd", "muon_nes") for seed in (0, 1)}
    assert tensorboard_view(view)[0] == ["report"]  # no run has curves here


def test_report_md_shows_every_figure_and_tensorboard_is_replaced(tmp_path):
    sweep = {"study": "hm", "experiment": "gpt2_small_fineweb", "seeds": [0],
             "grid": [{"optimizer": ["muon_nes", "muoneq_nes"], "optimizer.lr": [1e-3, 2e-3],
                       "optimizer.momentum": [0.9, 0.95]}],
             "objective": {"metric": "test_acc", "direction": "maximize"},
             "report": {"heatmaps": [{"x": "optimizer.lr", "y": "optimizer.momentum"}],
                        "tables": [{"name": "t", "select": ["optimizer.lr",
                                                            "optimizer.momentum"]}]}}
    path, spec, study = stored_study(tmp_path, sweep)
    for i, p in enumerate(spec.points()):
        add_trial(study, (p.as_dict(), p.key), 0, 0.9 + 0.01 * i)
    for _ in range(2):  # a second report replaces the first one's TensorBoard images
        report = write_report(load_study_data(path, runs_dir=tmp_path / "runs"))
    assert len(list((report.out_dir / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    markdown = (report.out_dir / "report.md").read_text()
    pngs = sorted(p.name for p in report.out_dir.glob("*.png"))
    assert pngs == ["heatmaps.png", "optuna_contour_Muon-Nes.png", "optuna_contour_MuonEq-Nes.png",
                    "optuna_slice_Muon-Nes.png", "optuna_slice_MuonEq-Nes.png", "robustness.png"]
    for name in pngs:
        assert f"]({name})" in markdown, name
    # TensorBoard's Images tab shows every image 350 pixels wide: a figure of one panel goes
    # there as its PNG, pixel for pixel, one of several panels as one image per panel, drawn
    # alone, so that 10-point text (the heatmaps' digits) is shown at least 10 pixels tall
    # (when both heatmaps went as one image it was 4 pixels, a contour of two axes 7)
    from muoneq.suite.report.figures import card_text_px

    events = EventAccumulator(str(report.out_dir / "tensorboard"),
                              size_guidance={IMAGES: 0}).Reload()
    images = {tag: imread(io.BytesIO(events.Images(tag)[-1].encoded_image_string))
              for tag in events.Tags()[IMAGES]}
    methods = ("Muon-Nes", "MuonEq-Nes")
    assert sorted(images) == sorted([
        "robustness", *(f"heatmaps/{m}" for m in methods),
        *(f"optuna/contour/{m}" for m in methods),
        *(f"optuna/slice/{m}/{axis}" for m in methods for axis in ("lr", "momentum"))])
    for one in ("robustness", "optuna/contour/Muon-Nes"):
        assert np.array_equal(images[one], imread(report.out_dir / f"{one.replace('/', '_')}.png"))
    for tag, image in images.items():
        assert card_text_px(10, image.shape[1]) >= 10, (tag, image.shape)
    whole = imread(report.out_dir / "heatmaps.png")
    for m in methods:  # one panel of the two, not the figure
        panel = images[f"heatmaps/{m}"]
        assert panel.shape[1] < whole.shape[1] / 1.5


def test_heatmap_panels_are_laid_out_as_the_paper_s_figure_8():
    """A column per optimizer, a row per K (Figure 8: Muon-Nes and MuonEq-Nes at K = 4, 5)."""
    from muoneq.suite.report.figures import panel_layout

    keys = [("muon_nes", None, 4), ("muon_nes", None, 5), ("muoneq_nes", "R", 4),
            ("muoneq_nes", "R", 5)]
    axes = ["optimizer", "optimizer.mode", "optimizer.ns_steps"]
    assert panel_layout(keys, axes) == {keys[0]: (0, 0), keys[1]: (1, 0), keys[2]: (0, 1),
                                        keys[3]: (1, 1)}
    assert panel_layout([(4,), (5,)], ["optimizer.ns_steps"]) == {(4,): (0, 0), (5,): (0, 1)}
    assert panel_layout([()], []) == {(): (0, 0)}


def test_heatmap_cells_side_by_side_print_apart(tmp_path):
    """11.06 and 11.12 next to each other: not both "11.1"."""
    values = {(0.02, 0.9): 11.06, (0.04, 0.9): 11.12, (0.02, 0.95): 12.5, (0.04, 0.95): 13.0}
    rows = [(opt("muon_nes", lr, **{"optimizer.momentum": m}), [v])
            for (lr, m), v in values.items()]
    (panel,) = heatmaps(runs_of(rows, "ppl"), HeatmapSpec(), [*AXES, "optimizer.momentum"],
                        "ppl", "minimize", tmp_path)
    texts = sorted(t.get_text() for t in panel.ax.texts)
    assert texts == ["11.06", "11.12", "12.50", "13.00"]


def test_rows_run_at_one_momentum_get_no_heatmap(tmp_path):
    rows = [(opt("muon_nes", lr, **{"optimizer.momentum": m}), [5.0 + lr + m])
            for lr in (0.02, 0.04) for m in (0.6, 0.9)]
    rows += [(opt("muoneq_nes", lr, "C", **{"optimizer.momentum": 0.9}), [5.0]) for lr in
             (0.02, 0.04)]
    rows += [(opt("adamw", 1e-3), [9.0])]
    panels = heatmaps(runs_of(rows, "ppl"), HeatmapSpec(), [*AXES, "optimizer.momentum"], "ppl",
                      "minimize", tmp_path)
    assert [p.title for p in panels] == ["Muon-Nes"]  # MuonEq-Nes (C): one momentum; AdamW: none
    assert panels[0].ax.images[0].get_clim() == pytest.approx((5.62, 5.94))  # its own


def test_number_format_is_one_for_the_figure():
    assert number_format([9.87, 10.4, 10.0]) == ".2f"  # 9.87, 10.40, 10.00
    assert number_format([0.0123, 0.5]) == ".4f"
    assert number_format([123.0, 4567.0, float("nan")]) == ".0f"
    # neighbours that would print alike get the digits that tell them apart (up to 5 sig.)
    assert number_format([11.06, 11.12, 12.0], [(11.06, 11.12), (11.12, 12.0)]) == ".2f"
    assert number_format([11.061, 11.064], [(11.061, 11.064)]) == ".3f"
    assert number_format([11.0611, 11.0612], [(11.0611, 11.0612)]) == ".3f"  # at most 5
    assert number_format([11.0, 11.0], [(11.0, 11.0)]) == ".1f"  # equal values: nothing to tell


def test_a_method_keeps_its_colour_in_every_figure_and_one_point_is_marked(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    palette = Palette([opt("muon_nes", 0.02), opt("muoneq_nes", 0.02, "R")])
    rows = [(opt(n, 0.02, m, **{"optimizer.ns_steps": k}), [5.0 - k])
            for n, m in (("muoneq_nes", "R"), ("muon_nes", None)) for k in (4, 5)]
    series, _ = line_plot(runs_of(rows, "val_ppl"), LineSpec(name="k", x="optimizer.ns_steps"),
                          [*AXES, "optimizer.ns_steps"], "val_ppl", "minimize", tmp_path,
                          palette=palette)
    assert {s.label: s.color for s in series} == {
        "MuonEq-Nes (R) | lr=0.02": palette.colour(opt("muoneq_nes", 0.02, "R")),
        "Muon-Nes | lr=0.02": palette.colour(opt("muon_nes", 0.02))}
    runs = []
    for i, (name, mode, steps) in enumerate((("muon_nes", None, [50]),
                                             ("muoneq_nes", "R", [10, 20, 30]))):
        with SummaryWriter(str(tmp_path / f"r{i}" / "tb")) as w:
            for step in steps:
                w.add_scalar("val_loss", 3.0 - step / 100, step)
        runs.append({**opt(name, 0.02, mode), "seed": 0, "val_ppl": 1.0,
                     "_status": "complete", "_run_dir": str(tmp_path / f"r{i}"), "_trial": i})
    plot = learning_curves(runs, CurveSpec(tags=["val_loss"]), AXES, "val_ppl", "minimize",
                           tmp_path, palette=palette)["val_loss"]
    lines = {line.get_label(): line for line in plot.figure.axes[0].get_lines()}
    muon = lines["Muon-Nes (lr=0.02), 1 seed, one point (step 50)"]
    muoneq = lines["MuonEq-Nes (R) (lr=0.02), 1 seed"]
    assert muon.get_marker() == "o" and muoneq.get_marker() == "o"  # few points: markers
    assert (muon.get_color(), muoneq.get_color()) == (palette.colour(opt("muon_nes", 0.02)),
                                                      palette.colour(opt("muoneq_nes", 0, "R")))
    assert muon.get_color() != muoneq.get_color()


def test_a_study_whose_runs_all_diverged_says_so(tmp_path, capsys):
    """It used to report "8 finished runs" and a table of dashes."""
    sweep = {"study": "div", "experiment": "cifar10_resnet18", "seeds": [0, 1],
             "grid": [{"optimizer": ["sgd", "muon_nes"], "optimizer.lr": [0.1, 0.05]}],
             "objective": {"metric": "test_acc", "direction": "maximize"}}
    _, spec, study = stored_study(tmp_path, sweep)
    for point in spec.points():
        for seed in (0, 1):
            add_trial(study, (point.as_dict(), point.key), seed, None, state=TrialState.FAIL,
                      outcome="diverged", metrics={
                          "status": "diverged", "test_acc": None, "diverged_at_step": 3,
                          "diverged": "the training loss is not finite (nan)"})
    from muoneq.suite.cli import main

    study_dir = tmp_path / "runs" / "div"
    first = study_dir / "trials" / "optimizer=sgd,optimizer.lr=0.1" / "seed0"
    assert main(["report", str(study_dir), "--no-tensorboard"]) == 2
    assert capsys.readouterr().err == (
        f"muoneq: study 'div' has 8 finished runs and every one diverged ({first} at step 3: the "
        "training loss is not finite (nan)), so no table or figure would hold a value; run it "
        "again with lower learning rates (the grid extended below its lowest optimizer.lr) or a "
        "larger trainer.divergence_patience\n")
    assert not (study_dir / "report").exists()
    assert report_main([str(study_dir), "--skip-empty"]) == 0
    assert capsys.readouterr().out.startswith(
        f"muoneq report: skipped study div ({study_dir}): it has 8 finished runs and every one "
        "diverged (")



def test_a_search_s_table_rounds_its_values_sorts_by_the_objective_and_counts_pruned(tmp_path):
    """A TPE study's rows are the sampler's points: labelled to three significant digits,
    best first; the report says how many trials the pruner stopped."""
    rows = [(opt("muoneq_nes", 0.044303752452182654, "R"), [7.6, 7.7]),
            (opt("muoneq_nes", 0.7780155576901415, "C"), [1.9, 2.0]),
            (opt("muoneq_nes", 0.00120392805220467, "C"), [63.0, 64.0])]
    table = build_table(runs_of(rows, "val_ppl"), TableSpec(select=[]), AXES, "val_ppl",
                        "minimize", [p for p, _ in rows], search=True)
    assert [label for label, _, _ in table.rows] == [
        "MuonEq-Nes (C) | lr=0.778", "MuonEq-Nes (R) | lr=0.0443", "MuonEq-Nes (C) | lr=0.0012"]
    sweep = {"study": "s", "experiment": "cifar10_resnet18", "seeds": [0],
             "search": {"params": {"optimizer.lr": {"type": "float", "low": 1e-3, "high": 1.0,
                                                    "log": True}}},
             "objective": {"metric": "test_acc", "direction": "maximize"}}
    path, spec, study = stored_study(tmp_path, sweep)
    add_trial(study, ({"optimizer.lr": 0.0123456}, "optimizer.lr=0.0123456"), 0, 0.9)
    for i in range(2):
        add_trial(study, ({"optimizer.lr": 0.5 + i}, f"optimizer.lr={0.5 + i}"), 0, None,
                  state=TrialState.PRUNED, outcome="pruned")
    report = write_report(load_study_data(path, runs_dir=tmp_path / "runs"), tensorboard=False)
    assert "2 trials were pruned (stopped early by Optuna's pruner" in report.markdown


def test_a_bracketed_heatmap_of_eight_columns_stays_legible_on_tensorboard(tmp_path):
    """The paper's 4 learning rates grow to 8 when bracketing extends both edges twice: each
    panel still goes to TensorBoard narrow enough for 10-point text to show 10 pixels tall,
    and no two cells' numbers overlap."""
    from muoneq.suite.report.figures import card_text_px

    class Images:  # the part of SummaryWriter that _save calls
        def __init__(self):
            self.logged = {}

        def add_image(self, tag, image, dataformats):
            assert dataformats == "HWC"
            self.logged[tag] = image

    lrs = [1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2]
    rows = [(opt(name, lr, mode, **{"optimizer.momentum": m}),
             [27.5 + i * 0.37 + j * 1.13 + (name == "muon_nes")])
            for name, mode in (("muon_nes", None), ("muoneq_nes", "R"))
            for i, lr in enumerate(lrs) for j, m in enumerate((0.85, 0.9, 0.95, 0.98))]
    writer = Images()
    panels = heatmaps(runs_of(rows, "val_ppl"), HeatmapSpec(),
                      [*AXES, "optimizer.momentum"], "val_ppl", "minimize", tmp_path, writer)
    assert len(panels) == 2 and all(p.grid.shape == (4, 8) for p in panels)
    for tag in ("heatmaps/Muon-Nes", "heatmaps/MuonEq-Nes (R)"):
        assert card_text_px(10, writer.logged[tag].shape[1]) >= 10, writer.logged[tag].shape
    for p in panels:
        boxes = [t.get_window_extent() for t in p.ax.texts]
        assert len(boxes) == 32
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        ticks = p.ax.get_xticklabels()
        assert [t.get_text() for t in ticks] == [
            "1.25e-4", "2.5e-4", "5e-4", "1e-3", "2e-3", "5e-3", "0.01", "0.02"]
        boxes = [t.get_window_extent() for t in ticks]  # level labels side by side, or slanted
        assert all(t.get_rotation() == 30 for t in ticks) or not any(
            a.overlaps(b) for a, b in itertools.pairwise(boxes))
