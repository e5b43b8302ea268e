"""Step-wise LR schedules: warmup + cosine / constant, applied to every param group."""

from __future__ import annotations

import io
import math

import pytest
import torch

from muoneq import MuonEq, param_groups
from muoneq.suite.runtime.schedule import build_scheduler, lr_factor


def test_cosine_with_warmup_hand_computed():
    f = lambda s: lr_factor(s, name="cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the 10 decay steps
    assert f(14) == pytest.approx(0.1) and f(20) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_constant_and_no_warmup():
    assert lr_factor(0, name="cosine", warmup_steps=0, total_steps=10) == 1.0
    assert lr_factor(5, name="cosine", warmup_steps=0, total_steps=10) == pytest.approx(0.5)
    assert [lr_factor(s, name="constant", warmup_steps=2, total_steps=5) for s in range(4)] == [
        0.5, 1.0, 1.0, 1.0]


def test_scheduler_drives_both_paths_and_resolves_the_budget_lazily():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = MuonEq(param_groups(model, lr=0.1))
    calls = []

    def budget():
        calls.append(1)
        return 10

    sched = build_scheduler(opt, name="cosine", warmup_steps=2, total_steps=budget)
    seen = []
    for _ in range(10):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert len(calls) == 1  # asked once, only when the decay started
    expected = [0.1 * lr_factor(s, name="cosine", warmup_steps=2, total_steps=10)
                for s in range(10)]
    for lrs, want in zip(seen, expected, strict=True):
        assert lrs == [pytest.approx(want)] * 2  # matrix and AdamW groups alike
    torch.save(sched.state_dict(), io.BytesIO())  # checkpointable (no closure in the state)


def test_schedule_warnings_for_runs_they_do_not_fit():
    from muoneq.suite.runtime.schedule import schedule_warnings

    def warn(**kw):
        args = dict(name="cosine", interval="step", warmup_steps=10, total_steps=None,
                    budget=100, min_lr_ratio=0.1)
        return schedule_warnings(**{**args, **kw})

    assert warn() == [] and warn(total_steps=100) == []
    # the 6-step GPT-2 run with 1,000 warmup steps: step 6 uses 6/1000 of the peak lr
    (text,) = warn(warmup_steps=1000, budget=6)
    assert text.startswith("schedule.warmup_steps=1000 is not shorter than this run's 6 "
                           "optimizer steps: the lr never decays")
    assert "last step uses 0.006 × optimizer.lr; lower schedule.warmup_steps" in text
    (text,) = warn(warmup_steps=5, budget=5)  # the peak only at the very last step
    assert "last step uses 1 × optimizer.lr" in text
    (short,) = warn(total_steps=60)
    assert "schedule.total_steps=60 differs from this run's 100 optimizer steps" in short
    assert "the last 40 optimizer steps stay at min_lr_ratio" in short
    assert "training stops at 100, before the cosine reaches its end (150)" in (
        warn(total_steps=150)[0])
    assert warn(name="constant", total_steps=60) == []  # constant: the length does not matter
    assert "this run's 3 epochs" in warn(interval="epoch", warmup_steps=3, budget=3)[0]
    assert len(warn(warmup_steps=70, total_steps=60)) == 2
