"""Every paper study in miniature, as a user runs it: ``make NAME MINI=1`` (docs/reproduce.md).

The sweep files' ``mini:`` sections keep each study's objective, search axes and report, bound
bracketing and name the study ``<study>-mini``; each miniature's make command line prepares its
real data offline and checks every run it would make (``ARGS=--dry-run``, the runs in a
temporary folder: ``ARGS=--runs-dir``), and two of them run in full and write their report,
whose header says what ran.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from muoneq.suite.sweeps import SweepError, load_sweep
from tests.helpers.commands import make
from tests.helpers.sweeps import write_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
#: the report's file that shows each miniature's table or figure
SHOWN = {"ablation-cifar10": "table_ablation.md", "ablation-gpt2": "table_ablation.md",
         "heatmap-gpt2": "heatmaps.png", "ksweep-gpt2": "ksweep.png",
         "lrsweep-llama130m": "lrsweep.png", "lrsweep-llama350m": "lrsweep.png",
         "table-llama": "table_compare.md"}


@pytest.mark.parametrize("name", SWEEPS)
def test_each_study_has_a_miniature_of_its_own_shape(name):
    full, mini = load_sweep(name), load_sweep(name, mini=True)
    assert mini.study == f"{name}-mini" and mini.mini is None
    assert mini.description.startswith(f"Miniature of {name} ({full.description}).")
    assert sorted(mini.axes()) == sorted(full.axes())  # the same study, fewer values
    assert (mini.objective, mini.report) == (full.objective, full.report)
    assert {mini.experiment_of(p) for p in mini.points()} <= {"mini_gpt2", "mini_llama",
                                                                "mini_resnet"}
    assert mini.bracket is None or mini.bracket.max_extensions == 1  # bracketing has a bound
    assert load_sweep(name, ["seeds=[3]"], mini=True).seeds == [3]  # --set after the miniature


def test_a_miniature_keeps_the_axes_and_is_asked_of_a_sweep_that_has_one(tmp_path):
    plain = write_sweep(tmp_path / "s.yaml")
    with pytest.raises(SweepError, match="no 'mini:' section, so no miniature of study tiny"):
        load_sweep(plain, mini=True)
    other = write_sweep(tmp_path / "o.yaml", mini={"grid": [{"optimizer": ["muon_nes"]}]})
    with pytest.raises(SweepError, match=r"mini.grid's axes \(optimizer\) must be the sweep's "
                                         r"\(optimizer, optimizer.lr\)"):
        load_sweep(other)


@pytest.mark.slow
def test_every_miniature_prepares_its_data_and_checks_every_run_through_make(tmp_path):
    """``make <target> MINI=1 ARGS=--dry-run`` for every study: its data prepared offline (real
    text, real images), every value of every axis composed as ``muoneq train`` will, the
    report's metrics checked; nothing run (the runs of each are ``make miniatures``' to time:
    the suite's budget holds two of them, below)."""
    done = make("-j2", *SWEEPS, "MINI=1", f"ARGS=--dry-run --runs-dir {tmp_path}", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for name in SWEEPS:
        spec = load_sweep(name, mini=True)
        assert (f"study {name}-mini: {len(spec.points())} points × {len(spec.seeds)} seeds"
                in done.stdout)
        data = tmp_path / f"{name}-mini" / "data"
        assert (data / ("digits.npz" if name == "ablation-cifar10" else "prepare.json")).is_file()
    assert "not on this machine" not in done.stdout + done.stderr  # the data is there


#: the miniatures the suite runs in full (a table with speedups and columns; a line figure);
#: every one is timed by `make miniatures` (benchmarks/results/miniatures.md)
RUN_IN_FULL = ["ksweep-gpt2", "table-llama"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_IN_FULL)
def test_make_target_mini_runs_the_study_in_miniature(name, tmp_path):
    """``make NAME MINI=1``: the miniature's runs, then its report (the make target's chained
    report reads the study the sweep ran: ``<study>-mini``), whose header says what ran."""
    done = make(name, "MINI=1", f"ARGS=--runs-dir {tmp_path}", timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    study = tmp_path / f"{name}-mini"
    report = study / "report"
    assert (report / SHOWN[name]).is_file(), sorted(p.name for p in report.iterdir())
    header = (report / "report.md").read_text().split("\n## ")[0]
    assert f"# {name}-mini\nMiniature of {name}" in header
    assert "Data: " in header and "in 32-true on" in header
    assert "(trainer.accelerator=cpu)" in header
    spec = load_sweep(name, mini=True)
    done_runs, total = map(int, re.search(rf"study {name}-mini: (\d+)/(\d+) runs done",
                                          done.stdout).groups())
    assert done_runs == total >= len(spec.points()) * len(spec.seeds)
    for metrics in study.glob("trials/*/seed*/metrics.json"):
        assert json.loads(metrics.read_text())["status"] == "finished"
