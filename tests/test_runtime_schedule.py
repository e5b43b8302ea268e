"""Step-wise LR schedules: warmup + cosine / constant, applied to every param group."""

from __future__ import annotations

import io
import math

import pytest
import torch

from muoneq import MuonEq, param_groups
from muoneq.runtime.schedule import build_scheduler, lr_factor


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
