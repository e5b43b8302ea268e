"""Grids that bracket their optimum and coordinate descent (muoneq.suite.sweeps.plan).

The plan is a pure function of the results: the first tests drive it with a known objective in
this process (each round "runs" every point the plan holds and plans again); the others run the
real driver on trial processes whose objective is a known function of the learning rate and
momentum (tests/helpers/sweep_objective_program.py): bracketing until the optimum is interior,
stopping at ``max_extensions``, resuming after a killed driver without repeating a run;
coordinate descent reaching the known optimum; the report, ``--status`` and ``--dry-run``
showing what was added.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from muoneq.suite.cli import main as cli
from muoneq.suite.report import load_study_data, write_report
from muoneq.suite.sweeps import Driver, DriverOptions, SweepError, load_sweep
from muoneq.suite.sweeps.plan import make_plan, spacing, step
from muoneq.suite.sweeps.spec import spec_from_dict
from muoneq.suite.sweeps.storage import open_storage
from tests.helpers.sweep_objective_program import objective
from tests.helpers.sweeps import COMMAND, view_targets


def sweep(**fields) -> dict:
    spec = {"study": "plan", "experiment": "synthetic", "overrides": ["opt_lr=0.3"],
            "seeds": [0, 1], "objective": {"metric": "val_loss"},
            "launch": {"command": COMMAND},
            "retry": {"max_retries": 1, "heartbeat_s": 0.5, "stale_after_s": 5.0}}
    spec.update(fields)
    return spec


def run_plan(spec, check=None, fail=()):
    """Plan, 'run' every new point on every seed with the known objective, repeat until the
    plan is finished; returns the last plan and how many times each point was asked for."""
    fixed = dict(o.split("=", 1) for o in spec.overrides)
    results, asked = {}, {}
    for _ in range(100):
        plan = make_plan(spec, results, check)
        new = [p for p in plan.points if p.key not in results]
        if not new:
            assert plan.finished
            return plan, asked
        for p in new:
            asked[p.key] = asked.get(p.key, 0) + 1
            args = {k: str(v) for k, v in p.items}
            results[p.key] = [None if p.key in fail else
                              objective({**fixed, **args, "seed": str(s)}) for s in spec.seeds]
    raise AssertionError("the plan never finished")


def lrs(plan, **fixed) -> list[float]:
    return sorted({p.as_dict()["optimizer.lr"] for p in plan.points
                   if all(p.as_dict().get(k) == v for k, v in fixed.items())})


# ------------------------------------------------------------------------------- spacing
def test_the_next_value_continues_the_grid_spacing_on_its_side():
    assert step([1e-3, 2e-3, 4e-3], "high", "log") == 8e-3
    assert step([1e-3, 2e-3, 5e-3], "high", "log") == 0.0125  # the spacing nearest that edge
    assert step([1e-3, 2e-3, 4e-3], "low", "log") == 5e-4
    assert step([0.85, 0.9, 0.95], "high", "linear") == 1.0
    assert step([0.85, 0.9, 0.95], "low", "linear") == 0.8
    assert step([2, 3, 4], "low", "linear") == 1 and isinstance(step([2, 3], "low", "linear"), int)
    assert spacing([5e-4, 1e-3, 2e-3, 5e-3], "auto") == "log"  # learning rates
    assert spacing([0.85, 0.9, 0.95, 0.98], "auto") == "linear"  # momenta
    assert spacing([1, 2, 4, 8], "auto") == "linear"  # integers (e.g. K)
    assert spacing([0.85, 0.9], "log") == "log"  # bracket.scale wins


# ------------------------------------------------------------------- bracketing, in-process
def test_bracketing_extends_until_the_optimum_is_interior():
    spec = spec_from_dict(sweep(grid=[{"optimizer.lr": [0.01, 0.02, 0.04]}],
                                bracket={"axes": ["optimizer.lr"], "max_extensions": 4}))
    plan, asked = run_plan(spec)
    (family,) = plan.families
    # optimum 0.3: 0.08, 0.16, 0.32 are each best at the high edge, 0.64 makes 0.32 interior
    assert family.status[0].added == [0.08, 0.16, 0.32, 0.64]
    assert family.state == "bracketed" and family.best.as_dict()["optimizer.lr"] == 0.32
    assert set(asked.values()) == {1}  # no point asked for twice


def test_bracketing_stops_at_max_extensions_and_says_so():
    spec = spec_from_dict(sweep(grid=[{"optimizer.lr": [0.01, 0.02, 0.04]}],
                                bracket={"axes": ["optimizer.lr"], "max_extensions": 2}))
    plan, _ = run_plan(spec)
    (family,) = plan.families
    assert family.status[0].added == [0.08, 0.16] and family.state == "edge"
    assert family.status[0].edge == "high"
    (line,) = plan.lines()
    assert "NOT bracketed: best 0.16 at the high edge, max_extensions=2 spent" in line


def test_bracketing_goes_down_and_follows_the_objective_direction():
    down = spec_from_dict(sweep(overrides=["opt_lr=0.001"], grid=[{"optimizer.lr": [0.01, 0.1]}],
                                bracket={"axes": ["optimizer.lr"]}))
    plan, _ = run_plan(down)
    assert plan.families[0].status[0].added == [0.001, 0.0001]
    # maximizing the same objective walks away from its minimum until max_extensions
    up = spec_from_dict(sweep(overrides=["opt_lr=0.001"], grid=[{"optimizer.lr": [0.01, 0.1]}],
                              bracket={"axes": ["optimizer.lr"], "max_extensions": 3},
                              objective={"metric": "val_loss", "direction": "maximize"}))
    plan, _ = run_plan(up)
    assert plan.families[0].status[0].added == [1.0, 10.0, 100.0]


def test_a_diverged_edge_brackets_the_optimum():
    spec = spec_from_dict(sweep(grid=[{"optimizer.lr": [0.01, 0.02, 0.04]}],
                                bracket={"axes": ["optimizer.lr"]}))
    plan, _ = run_plan(spec, fail={"optimizer.lr=0.08"})  # diverged: worse than anything
    assert plan.families[0].status[0].added == [0.08] and plan.families[0].state == "bracketed"


def test_bounds_and_config_errors_stop_the_extension():
    spec = spec_from_dict(sweep(
        overrides=["opt_lr=0.3", "opt_momentum=1.2"],
        grid=[{"optimizer.lr": [0.1, 0.3, 0.9], "optimizer.momentum": [0.9, 0.95]}],
        bracket={"axes": ["optimizer.lr", "optimizer.momentum"],
                 "bounds": {"optimizer.momentum": [0.0, 0.99]}}))
    plan, _ = run_plan(spec)
    lr_axis, momentum = plan.families[0].status
    assert lr_axis.added == [] and lr_axis.edge is None
    assert momentum.added == [] and momentum.edge == "high"
    assert momentum.stopped == "next value not tried: 1.0 leaves bracket.bounds [0.0, 0.99]"

    def check(point):
        return "optimizer.lr must be ≤ 1" if point.as_dict()["optimizer.lr"] > 1 else None

    spec = spec_from_dict(sweep(overrides=["opt_lr=5"], grid=[{"optimizer.lr": [0.25, 0.5]}],
                                bracket={"axes": ["optimizer.lr"]}))
    plan, _ = run_plan(spec, check=check)
    assert plan.families[0].status[0].added == [1.0]
    assert plan.families[0].status[0].stopped == (
        "next value not tried: optimizer.lr must be ≤ 1")


def test_families_split_by_every_axis_not_bracketed_and_grow_by_whole_slices():
    spec = spec_from_dict(sweep(
        overrides=["opt_lr=0.3", "opt_momentum=0.8"],
        grid=[{"optimizer": ["a", "b"], "optimizer.lr": [0.1, 0.2],
               "optimizer.momentum": [0.7, 0.8, 0.9]},
              {"optimizer": ["c"], "optimizer.lr": [1.0, 2.0]}],
        bracket={"axes": ["optimizer.lr"], "max_extensions": 3}))
    plan, _ = run_plan(spec)
    labels = [f.label for f in plan.families]
    assert labels == [f"optimizer={o} optimizer.momentum={m}" for o in "ab"
                      for m in (0.7, 0.8, 0.9)] + ["optimizer=c"]
    for f in plan.families[:6]:  # optimum 0.3: 0.4 beats 0.2, then 0.8 makes it interior
        assert f.status[0].added == [0.4, 0.8] and f.state == "bracketed"
    assert plan.families[6].status[0].added == [0.5, 0.25, 0.125]
    assert plan.families[6].state == "bracketed"
    # a 2-D bracket adds the new lr at every momentum of the family (a rectangle stays one)
    spec2 = spec_from_dict(sweep(
        overrides=["opt_lr=0.3", "opt_momentum=0.8"],
        grid=[{"optimizer.lr": [0.1, 0.2], "optimizer.momentum": [0.7, 0.8, 0.9]}],
        bracket={"axes": ["optimizer.lr", "optimizer.momentum"]}))
    plan, _ = run_plan(spec2)
    assert len(plan.points) == 4 * 3 and lrs(plan, **{"optimizer.momentum": 0.9}) == [
        0.1, 0.2, 0.4, 0.8]
    assert [s.added for s in plan.families[0].status] == [[0.4, 0.8], []]


@pytest.mark.parametrize("bracket, words", [
    ({"axes": ["optimizer.momentum"]}, ["bracket.axes: optimizer.momentum is not a grid axis"]),
    ({"axes": ["optimizer"]}, ["non-numeric"]),
    ({"axes": ["optimizer.lr"], "max_extensions": 0}, ["max_extensions ≥ 1"]),
    ({"axes": ["optimizer.lr"], "scale": {"optimizer.lr": "geometric"}},
     ["bracket.scale.optimizer.lr", "auto, log, linear"]),
    ({"axes": ["optimizer.lr"], "bounds": {"optimizer.lr": [1, 0]}}, ["low < high"]),
    ({"axes": ["optimizer.lr"], "bounds": {"optimizer.momentum": [0, 1]}},
     ["bracket.bounds.optimizer.momentum is not a bracketed axis"]),
])
def test_bracket_errors_name_the_field(bracket, words):
    with pytest.raises(SweepError) as err:
        spec_from_dict(sweep(grid=[{"optimizer": ["a"], "optimizer.lr": [0.1, 0.2]}],
                             bracket=bracket))
    for word in words:
        assert word in str(err.value)


# --------------------------------------------------------------- coordinate descent, in-process
def coordinate(**search) -> dict:
    params = {"optimizer.lr": {"values": [0.0375, 0.075, 0.15, 0.3, 0.6, 1.2]},
              "optimizer.momentum": {"values": [0.6, 0.7, 0.8, 0.9]}}
    return sweep(search={"type": "coordinate", "params": params,
                         "start": {"optimizer.lr": 0.0375, "optimizer.momentum": 0.9}, **search})


def test_coordinate_descent_reaches_the_known_optimum():
    plan, asked = run_plan(spec_from_dict(coordinate()))
    assert plan.state == "converged"
    moves = [(axis, point.key) for axis, point, _ in plan.path]
    assert moves == [(None, "optimizer.lr=0.0375 optimizer.momentum=0.9"),
                     ("optimizer.lr", "optimizer.lr=0.3 optimizer.momentum=0.9"),
                     ("optimizer.momentum", "optimizer.lr=0.3 optimizer.momentum=0.8")]
    assert plan.path[-1][2] == pytest.approx(0.0005)  # mean over seeds 0 and 1 at the optimum
    # start, the lr sweep, the momentum sweep, a second lr sweep at momentum 0.8 (no move)
    assert len(plan.points) == 1 + 5 + 3 + 5 and set(asked.values()) == {1}


def test_coordinate_descent_threshold_and_cycle_budget():
    # from 13: the lr sweep reaches 4 (69 % better), the momentum sweep 9 (31 %): neither
    # clears 80 %, so one cycle moves nothing; at 60 % the lr move is taken
    plan, _ = run_plan(spec_from_dict(coordinate(threshold=0.8)))
    assert [axis for axis, _, _ in plan.path] == [None] and plan.state == "converged"
    plan, _ = run_plan(spec_from_dict(coordinate(threshold=0.6)))
    assert [axis for axis, _, _ in plan.path] == [None, "optimizer.lr", "optimizer.momentum"]
    plan, _ = run_plan(spec_from_dict(coordinate(max_cycles=1)))
    assert plan.state == "max_cycles=1 reached" and len(plan.points) == 1 + 5 + 3


@pytest.mark.parametrize("search, words", [
    ({"start": {"optimizer.lr": 0.1}}, ["search.start.optimizer.momentum is missing"]),
    ({"params": {"optimizer.lr": {"low": 0.1, "high": 1.0}}}, ["takes 'values'"]),
    ({"start": {"optimizer.lr": 0.1, "optimizer.momentum": 0.9, "x": 1}},
     ["search.start.x is not a search axis"]),
    ({"type": "grid"}, ["search.type='grid'", "tpe, coordinate"]),
])
def test_coordinate_errors_name_the_field(search, words):
    with pytest.raises(SweepError) as err:
        spec = coordinate()
        spec["search"].update(search)
        spec_from_dict(spec)
    for word in words:
        assert word in str(err.value)


# ------------------------------------------------------------------- the driver, for real
def write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def sweep_cli(path: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "muoneq", "sweep", str(path), "--runs-dir",
            str(tmp_path / "runs"), "--poll", "0.2", *extra]


def starts(study_dir: Path) -> dict[str, int]:
    return {str(p.parent.relative_to(study_dir)): len(p.read_text().splitlines())
            for p in study_dir.glob("trials/*/*/starts.log")}


BRACKETED = sweep(grid=[{"optimizer": ["a"], "optimizer.lr": [0.01, 0.02, 0.04]},
                        {"optimizer": ["b"], "optimizer.lr": [0.05, 0.1]}],
                  bracket={"axes": ["optimizer.lr"], "max_extensions": 3})


@pytest.mark.slow
@pytest.mark.distributed
def test_bracketing_driver_resumes_after_a_kill_without_repeating_a_run(tmp_path):
    spec = {**BRACKETED, "overrides": ["opt_lr=0.3", "sleep_s=0.15"]}
    path = write(tmp_path, spec)
    study_dir = tmp_path / "runs" / "plan"
    proc = subprocess.Popen(sweep_cli(path, tmp_path, "--workers", "2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    # kill it once bracketing has added a value (a run beyond the written grid finished)
    while not list(study_dir.glob("trials/optimizer=a,optimizer.lr=0.08/*/metrics.json")):
        assert proc.poll() is None and time.time() < deadline, "bracketing never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run(sweep_cli(path, tmp_path, "--workers", "2"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = starts(study_dir)
    assert set(runs.values()) == {1}, runs  # every run folder executed once
    # a: 0.08, 0.16, 0.32 added and max_extensions spent; b: 0.2, 0.4 added, 0.4 interior?
    # (optimum 0.3: 0.4 beats 0.2, so 0.8 is added and 0.4 is interior)
    expected = {f"optimizer=a,optimizer.lr={v}" for v in (0.01, 0.02, 0.04, 0.08, 0.16, 0.32)}
    expected |= {f"optimizer=b,optimizer.lr={v}" for v in (0.05, 0.1, 0.2, 0.4, 0.8)}
    assert {k.split("/")[1] for k in runs} == expected
    assert len(runs) == 2 * len(expected)
    status = subprocess.run(sweep_cli(path, tmp_path, "--status"), capture_output=True,
                            text=True, timeout=120)
    assert "22/22 runs done" in status.stdout
    assert ("optimizer=a: optimizer.lr (log) NOT bracketed: best 0.32 at the high edge, "
            "max_extensions=3 spent (added 0.08, 0.16, 0.32)") in status.stdout
    assert ("optimizer=b: optimizer.lr (log) bracketed, best 0.4 (added 0.2, 0.4, 0.8)"
            in status.stdout)


@pytest.mark.slow
def test_report_and_dry_run_show_what_bracketing_added(tmp_path, capsys):
    path = write(tmp_path, BRACKETED)
    summary = Driver(load_sweep(path), DriverOptions(runs_dir=tmp_path / "runs", workers=2,
                                                     poll_s=0.2, tick_s=0.05)).run()
    assert (summary.done, summary.total, summary.exit_code) == (22, 22, 0)
    # TensorBoard's view names every run once, those bracketing added too
    study_dir = tmp_path / "runs" / "plan"
    view = view_targets(study_dir)
    assert sorted(view.values()) == sorted(p.relative_to(study_dir)
                                           for p in study_dir.glob("trials/*/seed*"))
    assert view["a,lr=0.32/seed1"] == Path("trials/optimizer=a,optimizer.lr=0.32/seed1")
    report = write_report(load_study_data(tmp_path / "runs" / "plan"), tensorboard=False)
    table = (report.out_dir / "plan.md").read_text()
    assert ("| optimizer=a | optimizer.lr (log) | 0.01, 0.02, 0.04, 0.08, 0.16, 0.32 | "
            "0.08, 0.16, 0.32 | 0.32 | **no**: best at the high edge; max_extensions=3 spent |"
            in table)
    assert "| optimizer=b | optimizer.lr (log) | 0.05, 0.1, 0.2, 0.4, 0.8 | 0.2, 0.4, 0.8 | " \
           "0.4 | yes |" in table
    assert "## Bracketing" in report.markdown
    # the table chose each optimizer's best lr among the added values too
    rows = {r[0]: r[2][None].selected["optimizer.lr"] for r in report.tables[0].rows}
    assert rows == {"a": 0.32, "b": 0.4}
    capsys.readouterr()
    assert cli(["sweep", str(path), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "5 points × 2 seeds = 10 runs" in out
    assert "bracketing optimizer.lr: up to 3 more values per family and axis" in out
    assert "optimizer=b: optimizer.lr (log) bracketed, best 0.4 (added 0.2, 0.4, 0.8)" in out


@pytest.mark.slow
def test_coordinate_descent_driver_runs_each_point_once(tmp_path):
    path = write(tmp_path, coordinate())
    summary = Driver(load_sweep(path), DriverOptions(runs_dir=tmp_path / "runs", workers=2,
                                                     poll_s=0.2, tick_s=0.05)).run()
    assert (summary.done, summary.exit_code) == (2 * 14, 0)
    data = load_study_data(tmp_path / "runs" / "plan")
    assert data.plan["state"] == "converged"
    assert data.plan["path"][-1]["point"] == {"optimizer.lr": 0.3, "optimizer.momentum": 0.8}
    assert set(starts(tmp_path / "runs" / "plan").values()) == {1}
    study_dir = tmp_path / "runs" / "plan"  # a search's runs in TensorBoard's view, each once
    assert sorted(view_targets(study_dir).values()) == sorted(
        p.relative_to(study_dir) for p in study_dir.glob("trials/*/seed*"))
    md = write_report(data, tensorboard=False).markdown
    assert "## Coordinate descent (converged)" in md
    assert "| 2 | optimizer.momentum | optimizer.lr=0.3 optimizer.momentum=0.8 | 0.0005 |" in md


@pytest.mark.slow
def test_an_edited_grid_grows_its_study(tmp_path):
    """Optuna's GridSampler could not: its grid is a categorical whose choices are fixed."""
    spec = sweep(grid=[{"optimizer.lr": [0.1, 0.2]}], seeds=[0])
    opts = DriverOptions(runs_dir=tmp_path / "runs", poll_s=0.2, tick_s=0.05)
    assert Driver(load_sweep(write(tmp_path, spec)), opts).run().done == 2
    spec.update(grid=[{"optimizer.lr": [0.1, 0.2, 0.4]}], seeds=[0, 1])
    summary = Driver(load_sweep(write(tmp_path, spec)), opts).run()
    assert (summary.done, summary.total, summary.exit_code) == (6, 6, 0)
    assert set(starts(tmp_path / "runs" / "plan").values()) == {1}
    study = optuna.load_study(study_name="plan",
                              storage=open_storage(None, tmp_path / "runs" / "plan"))
    values = {t.user_attrs["run_key"]: t.value for t in study.get_trials()
              if t.value is not None}
    assert values["optimizer.lr=0.4 | seed=1"] == pytest.approx(
        math.log2(0.4 / 0.3) ** 2 + 0.001)
    metrics = json.loads(next((tmp_path / "runs" / "plan").glob(
        "trials/optimizer.lr=0.4/seed1/metrics.json")).read_text())
    assert metrics["val_loss"] == values["optimizer.lr=0.4 | seed=1"]


def test_the_readme_snippets_are_valid_sweep_blocks():
    text = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    bracket = next(b for b in blocks if "bracket" in b)
    spec = spec_from_dict(sweep(grid=[{"optimizer.lr": [1e-3, 2e-3]}], **bracket))
    assert spec.bracket.axes == ["optimizer.lr"] and spec.bracket.max_extensions == 2
    search = next(b for b in blocks if "search" in b)
    spec = spec_from_dict(sweep(**search))
    assert spec.kind == "coordinate" and list(spec.search.start) == list(spec.search.params)
