"""Every paper study in miniature, as a user runs it: ``make NAME MINI=1`` (docs/reproduce.md).

The sweep files' ``mini:`` sections keep each study's objective, search axes and report, bound
bracketing and name the study ``<study>-mini``; each miniature's make command line prepares its
real data offline and checks every run it would make (``ARGS=--dry-run``, the runs in a
temporary folder: ``ARGS=--runs-dir``), and two of them run in full and write their report,
whose header says what ran.
"""

from __future__ import annotations

import json
import os
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


def check_miniature(name: str, study: Path, stdout: str) -> None:
    """The study ``make NAME MINI=1`` ran into ``study``: every run finished, and the report
    whose header says what ran."""
    report = study / "report"
    assert (report / SHOWN[name]).is_file(), sorted(p.name for p in report.iterdir())
    header = (report / "report.md").read_text().split("\n## ")[0]
    assert f"# {name}-mini\nMiniature of {name}" in header
    assert "Data: " in header and "in 32-true on" in header
    assert "(trainer.accelerator=cpu)" in header
    spec = load_sweep(name, mini=True)
    done_runs, total = map(int, re.search(rf"study {name}-mini: (\d+)/(\d+) runs done",
                                          stdout).groups())
    assert done_runs == total >= len(spec.points()) * len(spec.seeds)
    for metrics in study.glob("trials/*/seed*/metrics.json"):
        assert json.loads(metrics.read_text())["status"] == "finished"


@pytest.mark.slow
def test_make_target_mini_runs_the_study_in_miniature(tmp_path):
    """``make table-llama MINI=1``: the miniature's runs, then its report (the make target's
    chained report reads the study the sweep ran: ``<study>-mini``)."""
    done = make("table-llama", "MINI=1", f"ARGS=--runs-dir {tmp_path}", timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    check_miniature("table-llama", tmp_path / "table-llama-mini", done.stdout)


@pytest.mark.slow
def test_make_miniatures_times_a_miniature_and_records_what_it_printed(tmp_path):
    """``make miniatures NAMES=ksweep-gpt2``: ``make ksweep-gpt2 MINI=1`` run from an empty
    folder and timed, its record (JSON and Markdown: machine, load, commit, the first table or
    figure of its report) written, and a row of an earlier record kept."""
    from muoneq.suite import code_version

    out = tmp_path / "record"
    earlier = {"name": "demo", "command": "make demo", "seconds": 300.0, "exit_code": 0,
               "runs": 45, "load_before": 0.5, "load_after": 0.7, "shows": "| a |\n|--|",
               "date": "2026-01-01T00:00:00+00:00", "commit": "0123456789", "cpu": "a CPU",
               "cores": 2}
    out.with_suffix(".json").write_text(json.dumps({"miniatures": [earlier]}))
    (tmp_path / "ksweep-gpt2-mini").mkdir()  # what an earlier run left: removed first
    (tmp_path / "ksweep-gpt2-mini" / "stale").write_text("")
    done = make("miniatures", "NAMES=ksweep-gpt2",
                f"ARGS=--runs-dir {tmp_path} --out {out}", timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    study = tmp_path / "ksweep-gpt2-mini"
    assert not (study / "stale").exists()
    record = json.loads(out.with_suffix(".json").read_text())["miniatures"]
    assert [m["name"] for m in record] == ["ksweep-gpt2", "demo"]  # the sweeps first
    entry = record[0]
    spec = load_sweep("ksweep-gpt2", mini=True)
    assert entry["command"] == "make ksweep-gpt2 MINI=1" and entry["exit_code"] == 0
    assert entry["runs"] == len(list(study.glob("trials/*/seed*/metrics.json"))) \
        >= len(spec.points()) * len(spec.seeds)
    assert 0 < entry["seconds"] < 900 and entry["cores"] == os.cpu_count()
    version = code_version.current()
    assert entry["commit"].startswith(version.commit[:10])
    assert entry["shows"] == ", ".join(sorted(p.name for p in (study / "report").glob("*.png")
                                              if not p.name.startswith("optuna")))
    assert "ksweep.png" in entry["shows"]
    text = out.with_suffix(".md").read_text()
    minutes, seconds = divmod(round(entry["seconds"]), 60)
    assert (f"| `make ksweep-gpt2 MINI=1` | {minutes} min {seconds:02d} s | {entry['runs']} | "
            in text)
    assert "| `make demo` | 5 min 00 s | 45 | a CPU, 2 cores |" in text
    assert f"## ksweep-gpt2\n\n`make ksweep-gpt2 MINI=1` printed:\n\n{entry['shows']}" in text


def test_the_readme_shows_the_demo_table_make_miniatures_recorded():
    """The README's demo table is the one ``make demo`` printed in the record of ``make
    miniatures``, without its s/step column (a time: the record's); its time is linked, not
    typed."""
    record = json.loads((REPO / "benchmarks" / "results" / "miniatures.json").read_text())
    demo = next(m for m in record["miniatures"] if m["name"] == "demo")
    def cells(table: str) -> list[list[str]]:
        return [[c.strip() for c in row.strip().strip("|").split("|")]
                for row in table.splitlines()]

    printed = [row[:-1] for row in cells(demo["shows"].split("\n\n")[0])]
    readme = (REPO / "README.md").read_text()
    assert cells(re.search(r"\n(\| Method \|.*?)\n\n", readme, re.S).group(1)) == printed
    assert "benchmarks/results/miniatures.md#demo" in readme
