"""Paired differences with Student-t intervals and token-efficiency speedups, against hand
computations and synthetic curves with known crossings."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import optuna
import pytest
import yaml
from matplotlib.image import imread
from torch.utils.tensorboard import SummaryWriter

from muoneq.suite.demo import demo_sweep
from muoneq.suite.report import paired
from muoneq.suite.report.cli import main as report_main
from muoneq.suite.report.paired import Interval, comparisons
from muoneq.suite.report.speedup import crossing
from muoneq.suite.report.tables import build_table
from muoneq.suite.runtime import compose
from muoneq.suite.sweeps.report_spec import MetricColumn, TableSpec
from muoneq.suite.sweeps.spec import SweepError, load_sweep, spec_from_dict, spec_to_dict
from muoneq.suite.sweeps.storage import open_storage
from tests.helpers.report import add_trial

SWEEPS = Path(__file__).parents[1] / "sweeps"
T_975_2 = 4.302652729749462  # t_{0.975, 2}, as printed in Student-t tables (4.303)


def test_interval_matches_a_hand_computation():
    d = Interval((0.1, 0.3, 0.2))
    # mean 0.2, sd 0.1, t_{0.975,2} = 4.303: 4.303 · 0.1 / √3 = 0.2484
    assert d.n == 3 and d.mean == pytest.approx(0.2)
    assert d.half_width == pytest.approx(T_975_2 * 0.1 / math.sqrt(3)) == pytest.approx(0.2484,
                                                                                        abs=1e-4)
    assert (d.low, d.high) == (pytest.approx(-0.0484, abs=1e-4), pytest.approx(0.4484, abs=1e-4))
    assert d.verdict("minimize") is None  # the interval holds zero: no win, no loss
    below = Interval((-0.2, -0.4, -0.3))  # -0.3 ± 0.2484: excludes zero
    assert below.verdict("minimize") == "better" and below.verdict("maximize") == "worse"
    assert Interval((0.2, 0.4, 0.3)).verdict("maximize") == "better"
    assert Interval((1.0, 2.0)).half_width == pytest.approx(12.706204736 * 0.5 ** 0.5 / 2 ** 0.5)
    one = Interval((0.3,))
    assert one.half_width is None and one.low is None and one.verdict("minimize") is None


def records(rows: list[tuple[dict, dict[int, float]]], metric: str, **extra) -> list[dict]:
    """One record per seed, as muoneq.suite.report.records builds them (seeds given explicitly)."""
    out = []
    for point, by_seed in rows:
        for seed, value in by_seed.items():
            out.append({**point, "seed": seed, metric: value,
                        **{k: f(point, seed) for k, f in extra.items()}, "_status": "complete",
                        "_run_dir": f"/nowhere/{len(out)}", "_trial": len(out)})
    return out


def opt(name, lr, mode=None):
    return {"optimizer": name, "optimizer.lr": lr, "optimizer.mode": mode}


AXES = ["optimizer", "optimizer.lr", "optimizer.mode"]
PPL = [
    (opt("muon_nes", 0.02), {0: 5.0, 1: 5.4, 2: 5.2}),  # best Muon-Nes
    (opt("muon_nes", 0.04), {0: 6.0, 1: 6.0, 2: 6.0}),
    # seeds listed in another order: pairs are made by seed, not by position
    (opt("muoneq_nes", 0.02, "R"), {2: 4.9, 0: 4.8, 1: 5.0}),  # -0.2, -0.4, -0.3
    (opt("muoneq_nes", 0.02, "C"), {0: 5.1, 1: 5.2, 2: 5.3}),  # +0.1, -0.2, +0.1
    (opt("muoneq_nes", 0.02, "RC"), {1: 5.1}),  # one seed: -0.3, no interval
    (opt("adamw", 1e-3), {0: 10.0, 1: 10.5, 2: 10.3}),
]
STEP_TIME = {"muon_nes": 0.10, "muoneq_nes": 0.11, "adamw": 0.09}


def ppl_table():
    runs = records(PPL, "val/ppl", step_time_s=lambda p, s: STEP_TIME[p["optimizer"]]
                   + (0.01 * s if p["optimizer"] == "muoneq_nes" else 0.0))
    spec = TableSpec(name="ablation", metrics=[
        MetricColumn(key="val/ppl", label="ppl"),
        MetricColumn(key="step_time_s", label="s/step", digits=3)])
    return build_table(runs, spec, AXES, "val/ppl", "minimize", [p for p, _ in PPL])


def test_paired_differences_by_seed_against_each_baseline():
    table = ppl_table()
    found = comparisons(table)
    assert [c.label for c in found] == [
        "Muon-Nes − AdamW", "MuonEq-Nes (R) − Muon-Nes", "MuonEq-Nes (R) − AdamW",
        "MuonEq-Nes (C) − Muon-Nes", "MuonEq-Nes (C) − AdamW", "MuonEq-Nes (RC) − Muon-Nes",
        "MuonEq-Nes (RC) − AdamW"]
    r = found[1].differences["val/ppl"]
    assert r.values == pytest.approx((-0.2, -0.4, -0.3))  # seeds 0, 1, 2
    assert (r.mean, r.half_width) == (pytest.approx(-0.3), pytest.approx(T_975_2 * 0.1 / 3**.5))
    md = paired.to_markdown(table, found).splitlines()
    assert md[1] == "| Candidate − baseline | seed pairs | Δ ppl [95% CI] | Δ s/step [95% CI] |"
    # Muon-Nes − AdamW: -5.0, -5.1, -5.1 (mean -5.067, sd 0.0577, ±0.143); step time -0.01 each
    assert md[3] == ("| Muon-Nes − AdamW | 3 | -5.07 [-5.21, -4.92] **better** | "
                     "+0.010 [+0.010, +0.010] worse |")
    # R: ±0.2484 around -0.30; step time +0.01, +0.02, +0.03 (seeds 0-2): ±0.0248 around 0.02
    assert md[4] == ("| MuonEq-Nes (R) − Muon-Nes | 3 | -0.30 [-0.55, -0.05] **better** | "
                     "+0.020 [-0.005, +0.045] |")
    # C: +0.1, -0.2, +0.1: mean 0, sd 0.173, ±0.430: no verdict
    assert md[6] == ("| MuonEq-Nes (C) − Muon-Nes | 3 | +0.00 [-0.43, +0.43] | "
                     "+0.020 [-0.005, +0.045] |")
    assert md[8] == ("| MuonEq-Nes (RC) − Muon-Nes | 1 | -0.30 (n=1, no interval) | "
                     "+0.020 (n=1, no interval) |")
    assert "95% Student-t interval" in md[-1] and "excludes zero" in md[-1]
    tex = paired.to_latex(table, found)
    assert r"MuonEq-Nes (R) -- Muon-Nes & 3 & $\mathbf{-0.30\,[-0.55, -0.05]}$ & " \
           r"$+0.020\,[-0.005, +0.045]$ \\" in tex
    assert r"$-0.30$ (n=1)" in tex
    # worse is marked too, as in the Markdown table (Muon-Nes's step time against AdamW's)
    assert r"Muon-Nes -- AdamW & 3 & $\mathbf{-5.07\,[-5.21, -4.92]}$ & " \
           r"$+0.010\,[+0.010, +0.010]$ (worse) \\" in tex


def test_a_diverged_or_missing_baseline_gives_no_pairs():
    rows = [(opt("muon_nes", 0.02), {0: float("nan"), 1: 5.0}),
            (opt("muoneq_nes", 0.02, "R"), {0: 4.0, 1: 4.5})]
    runs = records(rows, "val/ppl")
    table = build_table(runs, TableSpec(name="t"), AXES, "val/ppl", "minimize",
                        [p for p, _ in rows])
    (c,) = comparisons(table)  # no AdamW row: only the Muon counterpart
    assert c.differences["val/ppl"] is None  # Muon-Nes's only setting diverged on a seed
    assert "| MuonEq-Nes (R) − Muon-Nes | 0 | — |" in paired.to_markdown(table, [c])


# ------------------------------------------------------------------------------ speedups
def test_crossing_is_interpolated_in_log_tokens():
    x, problem = crossing([(1000, 3.0), (1200, 2.0)], 2.5, max_gap=0.25)
    assert problem is None and x == pytest.approx(1000 * 1.2 ** 0.5)  # halfway in log-tokens
    x, problem = crossing([(1000, 3.0), (1200, 2.5), (1400, 2.0)], 2.5, max_gap=0.25)
    assert x == pytest.approx(1200)  # a validation exactly at the target
    assert crossing([(1000, 3.0), (2000, 2.0)], 2.5, max_gap=0.25) == (
        None, "crosses it between validations at 1k tokens and 2k tokens, more than 25% apart: "
              "too coarse to interpolate")
    assert crossing([(10, 2.0), (20, 1.0)], 2.5, max_gap=0.25, unit="steps") == (
        None, "already below it at its first validation (10 steps): too coarse to interpolate")
    assert crossing([(1e6, 3.0), (2e6, 2.9)], 2.5, max_gap=0.25) == (
        None, "never reaches it (its last validation: 2.9 at 2M tokens)")


def log_linear(tokens: float) -> float:
    """A candidate's loss linear in log-tokens: interpolation in log-tokens is exact on it."""
    return 5.0 - 0.5 * math.log(tokens / 1000)


SHARES = {0: 0.74, 1: 0.81, 2: 0.88}  # where the candidate reaches each seed's target


def write_curves(run_dir, tag: str, curve: dict[int, float]) -> None:
    with SummaryWriter(str(run_dir / "tensorboard")) as w:
        for step, value in curve.items():
            w.add_scalar(tag, value, step)


def speedup_study(tmp_path, shares=SHARES, every=10, tokens=True):
    """Muon-Nes trains 50 steps of 2,000 tokens (100k), MuonEq-Nes (R) 100 steps of 1,000;
    MuonEq's loss is linear in log-tokens and reaches Muon-Nes's final loss of seed s at
    ``shares[s]`` of 100k tokens. Without ``tokens``, metrics.json reports no tokens per step."""
    sweep = {"study": "speed", "experiment": "llama_tiny_shakespeare", "seeds": list(shares),
             "grid": [{"optimizer": ["muon_nes"], "optimizer.lr": [0.02]},
                      {"optimizer": ["muoneq_nes"], "optimizer.mode": ["R"],
                       "optimizer.lr": [0.02]}],
             "objective": {"metric": "val/ppl", "direction": "minimize"},
             "report": {"tables": [{"name": "ablation", "metrics": [{"key": "val/ppl"}],
                                    "speedup": {"tag": "val/loss"}}]}}
    path = tmp_path / "speed.yaml"
    path.write_text(yaml.safe_dump(sweep))
    spec = load_sweep(path)
    study_dir = tmp_path / "runs" / "speed"
    study = optuna.create_study(study_name="speed", storage=open_storage(None, study_dir))
    study.set_user_attr("spec", spec_to_dict(spec))
    muon, muoneq = [(p.as_dict(), p.key) for p in spec.points()]
    for seed, share in shares.items():
        target = log_linear(share * 100_000)
        # validations every `every` optimizer steps and at the end (as the runtime does)
        base = {s: target + 0.01 * (50 - s) for s in {*range(every // 2, 50, every // 2), 50}}
        mine = {s: log_linear(s * 1000) for s in {*range(every, 100, every), 100}}
        for cell, curve, per_step in ((muon, base, 2000), (muoneq, mine, 1000)):
            metrics = {"val/ppl": math.exp(curve[max(curve)])}
            rel = add_trial(study, cell, seed, metrics["val/ppl"], metrics=(
                {**metrics, "tokens_per_step": per_step} if tokens else metrics))
            write_curves(study_dir / rel, "val/loss", curve)
    return study_dir


def test_speedup_on_curves_with_a_known_crossing(tmp_path, capsys):
    study_dir = speedup_study(tmp_path)
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    # shares 0.74, 0.81, 0.88: mean 81%, sd 0.07, ±4.303·0.07/√3 = ±17.4% → 64%–98%
    line = ("- MuonEq-Nes (R) reaches Muon-Nes's final val/loss at 81% (64–98%) of its tokens "
            "(mean and 95% interval over 3 seed pairs).")
    assert line in out.splitlines()
    report_dir = study_dir / "report"
    with (report_dir / "speedup_ablation.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["seed"] for r in rows] == ["0", "1", "2"]
    for r, share in zip(rows, SHARES.values(), strict=True):
        assert r["unit"] == "tokens" and float(r["baseline_final"]) == 100_000
        assert float(r["share"]) == pytest.approx(share, rel=1e-5)
    png = report_dir / "speedup_MuonEq-Nes_R_vs_Muon-Nes.png"
    assert imread(png).shape[0] > 100
    assert "](speedup_MuonEq-Nes_R_vs_Muon-Nes.png)" in (report_dir / "report.md").read_text()


def test_no_number_when_the_curves_are_too_coarse_or_never_cross(tmp_path, capsys):
    # MuonEq validated at 40k, 80k and 100k tokens: seed 0's crossing at 74k lies between 40k
    # and 80k (100% apart); seeds 1 and 2 cross between 80k and 100k (25%: fine)
    study_dir = speedup_study(tmp_path, every=40)
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert ("- MuonEq-Nes (R) vs Muon-Nes's final val/loss: no number (not every seed pair has "
            "one); seed 0: target 2.848, crosses it between validations at 40k tokens and 80k "
            "tokens, more than 25% apart: too coarse to interpolate; seed 1: 81%; seed 2: 88%. "
            "Validate more often (task.val_every_n_steps).") in out


def test_one_pair_has_no_interval_and_a_slower_candidate_never_reaches(tmp_path, capsys):
    study_dir = speedup_study(tmp_path, shares={0: 0.5})
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    assert ("- MuonEq-Nes (R) reaches Muon-Nes's final val/loss at 50% of its tokens (n=1, no "
            "interval).") in capsys.readouterr().out
    (tmp_path / "slow").mkdir()
    study_dir = speedup_study(tmp_path / "slow", shares={0: 1.5})
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    assert ("seed 0: target 2.495, never reaches it (its last validation: 2.697 at 100k "
            "tokens).") in capsys.readouterr().out


def test_speedup_by_optimizer_steps_when_runs_report_no_tokens(tmp_path, capsys):
    study_dir = speedup_study(tmp_path, tokens=False)
    assert report_main([str(study_dir), "--no-tensorboard"]) == 0
    # MuonEq crosses at steps 74, 81, 88 of Muon-Nes's 50: 148%, 162%, 176% (sd 14%, ±34.8%)
    assert ("- MuonEq-Nes (R) reaches Muon-Nes's final val/loss at 162% (127–197%) of its steps "
            "(mean and 95% interval over 3 seed pairs).") in capsys.readouterr().out


def test_speedup_max_gap_must_be_positive(tmp_path):
    sweep = {"study": "s", "experiment": "llama_tiny_shakespeare",
             "grid": [{"optimizer": ["muon_nes"]}], "objective": {"metric": "val/ppl"},
             "report": {"tables": [{"name": "t", "select": [], "speedup": {"max_gap": 0}}]}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep))
    with pytest.raises(SweepError, match=r"report.tables\[t\].speedup.max_gap must be > 0 "
                                         r"\(got 0.0\)"):
        load_sweep(path)


def test_paper_studies_with_speedups_validate_often_enough():
    """The recipes' validation cadence: a crossing anywhere after the first 10% of a run lies
    between two validations at most ``max_gap`` apart, so it is interpolated."""
    checked = 0
    for path in sorted(SWEEPS.glob("*.yaml")):
        spec = load_sweep(path)
        for table in spec.report.tables:
            if table.speedup is None:
                continue
            for experiment in {spec.experiment_of(p) for p in spec.points()}:
                cfg = compose([f"experiment={experiment}", *spec.overrides])
                every, steps = cfg.task.val_every_n_steps, cfg.trainer.max_steps
                assert every / (0.1 * steps) <= table.speedup.max_gap, (path.name, experiment)
                checked += 1
    assert checked >= 4  # ablation-gpt2 and table-llama's three sizes


def test_the_demo_reports_paired_differences_and_speedups_over_three_seeds(tmp_path):
    spec = spec_from_dict(demo_sweep(tmp_path), source="muoneq demo")
    (table,) = spec.report.tables
    assert table.deltas and table.speedup.tag == "val/loss"
    assert len(spec.seeds) == 3 and len(spec.points()) * len(spec.seeds) == 45
    assert spec.bracket.axes == ["optimizer.lr"]


def test_a_registered_optimizer_brings_its_label_and_counterpart(monkeypatch):
    from muoneq import registry
    from muoneq.suite.report.tables import setting_label

    monkeypatch.setattr(registry, "OPTIMIZERS", dict(registry.OPTIMIZERS))
    spec = registry.OPTIMIZERS["muoneq"]
    registry.register_optimizer("muoneq_rc", registry.OptimizerSpec(
        spec.factory, {"mode": "RC"}, "MuonEq (RC)", label="MuonEq-RC", counterpart="muon"))
    assert setting_label({"optimizer": "muoneq_rc"}) == "MuonEq-RC"
    assert paired.baselines_of("muoneq_rc") == ["muon", paired.BASELINE]
    assert setting_label({"optimizer": "unregistered"}) == "unregistered"
    with pytest.raises(ValueError, match="counterpart 'mu0n' is not registered"):
        registry.register_optimizer("other", registry.OptimizerSpec(
            spec.factory, counterpart="mu0n"))


def test_a_timing_column_says_what_it_ran_on_and_when_the_machine_was_busy():
    from muoneq.suite.report.machine import timing_note

    def run(load):
        return {"device": "AMD EPYC 7B13", "threads": 1, "cores": 2, "load_avg": load}

    # 2.2: the sweep's own two trials on the two cores and its driver: not busy
    idle = timing_note([run(1.2), run(2.2)], ["val/ppl", "step_time_s"])
    assert idle == ("\nstep_time_s measured on AMD EPYC 7B13, 1 CPU thread(s) per run, 2 cores; "
                    "the machine's 1-minute load average at the timed steps was 1.2 to 2.2 "
                    "(mean per run).\n")
    busy = timing_note([run(1.2), run(2.3), run(3.9)], ["step_time_s"])
    assert ("**The machine was busy** (a load over 10% above its cores) during 2 of 3 runs: a "
            "difference in step_time_s may be the load's, not the optimizers'") in busy
    assert timing_note([run(3.0)], ["val/ppl"]) == ""  # no timing column: nothing to say
    old = timing_note([{"step_time_s": 0.1}], ["step_time_s"])
    assert "did not record the machine's load" in old
