"""The step's fast paths give the paper's result: fused DiagPre, streaming, stacking, options."""

import json

import pytest
import torch
from torch import nn

from muoneq import MuonEq, diag_pre
from muoneq.newton_schulz import dtype_name, resolve_dtype
from muoneq.optim import HybridOrthogonalOptimizer, plan
from muoneq.optim.plan import Banked

MODES = ["none", "R", "C", "RC"]


pytestmark = pytest.mark.usefixtures("one_thread")


def params_and_grads(shapes, steps=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]
    return values, grads


def run(make_opt, values, grads):
    params = [nn.Parameter(v.clone()) for v in values]
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_diag_pre_is_diag_pre_then_the_cast(mode, dtype):
    M = torch.randn(3, 20, 12) * torch.logspace(-3, 2, 12)  # a stack, columns of many scales
    M[0, 4] = 0  # a zero row with eps > 0
    got = diag_pre(M, mode, 1e-8, dtype=dtype)
    want = diag_pre(M.double(), mode, 1e-8).to(dtype)
    assert got.dtype == dtype and got.shape == M.shape
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=0)


def test_fused_diag_pre_keeps_zero_rows_and_columns_with_eps_zero():
    M = torch.randn(6, 5)
    M[2] = 0
    M[:, 3] = 0
    out = diag_pre(M, "RC", 0.0, dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert (out[2] == 0).all() and (out[:, 3] == 0).all()
    torch.testing.assert_close(out, diag_pre(M, "RC", 0.0))


@pytest.mark.parametrize("nesterov", [False, True])
def test_mode_none_is_bitwise_torch_muon_over_a_set_of_matrices(nesterov):
    shapes = [(48, 16), (16, 16), (24, 40), (40, 24)]
    values, grads = params_and_grads(shapes, steps=4)
    ours, _ = run(lambda ps: MuonEq(ps, lr=0.02, mode="none", nesterov=nesterov,
                                    weight_decay=0.1, ns_dtype="bfloat16"), values, grads)
    theirs, _ = run(lambda ps: torch.optim.Muon(ps, lr=0.02, nesterov=nesterov, weight_decay=0.1,
                                                adjust_lr_fn="match_rms_adamw"), values, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("mode", MODES)
def test_stacked_batching_matches_per_matrix(mode, algorithm, monkeypatch):
    # two stacks of one shape (the chunk limit is lowered to 2 matrices), a conv filter, a
    # lone shape
    shapes = [(12, 20)] * 5 + [(8, 3, 2, 2), (20, 12)]
    monkeypatch.setattr(plan, "STACK_ELEMENTS", 2 * 12 * 20)
    values, grads = params_and_grads(shapes, dtype=torch.float64)

    def make(batching):
        return lambda ps: MuonEq(ps, lr=0.05, mode=mode, ns_dtype=torch.float64,
                                 batching=batching, ns_algorithm=algorithm)

    per_matrix, _ = run(make("per_matrix"), values, grads)
    stacked, _ = run(make("stacked"), values, grads)
    for a, b in zip(stacked, per_matrix, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_stacked_batching_in_bf16_differs_only_by_rounding():
    values, grads = params_and_grads([(32, 64)] * 3)
    per_matrix, _ = run(lambda ps: MuonEq(ps, lr=0.05, batching="per_matrix"), values, grads)
    stacked, _ = run(lambda ps: MuonEq(ps, lr=0.05, batching="stacked"), values, grads)
    for a, b, v in zip(stacked, per_matrix, values, strict=True):
        # three steps of size 0.05·0.2·√64 each; bf16 NS rounds at ~1e-2 of the update
        assert (a - b).abs().max() < 3 * 0.05 * 0.2 * 8 * 2e-2
        assert not torch.equal(a, v)


def test_persistent_state_is_as_large_as_torch_muons():
    shapes = [(48, 16), (16, 16), (24, 40)]
    values, grads = params_and_grads(shapes, steps=1)

    def state_bytes(opt):
        return sum(t.numel() * t.element_size() for s in opt.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))

    for mode in ("none", "R", "RC"):
        _, ours = run(lambda ps, mode=mode: MuonEq(ps, mode=mode), values, grads)
        _, theirs = run(lambda ps: torch.optim.Muon(ps), values, grads)
        assert state_bytes(ours) == state_bytes(theirs)


@pytest.mark.parametrize("batching", ["per_matrix", "stacked"])
def test_a_method_is_one_small_class_whose_rule_sees_stacks_with_their_state(batching):
    """``prepare`` and ``finish`` get the rows of one segment (a stack: one matrix per chunk on
    the per-matrix path), its parameters and its banked state, views of the optimizer's."""
    seen = []

    class Recording(HybridOrthogonalOptimizer):
        banked_state = {"calls": Banked(lambda layout: (), dtype=lambda _: torch.float32)}

        def finish(self, O, segment, group):
            segment.state["calls"].add_(1)
            seen.append(([tuple(p.shape) for p in segment.params], tuple(O.shape)))
            return O

    values, grads = params_and_grads([(6, 2, 2, 2), (5, 7), (5, 7)], steps=2)
    _, opt = run(lambda ps: Recording(ps, lr=0.1, batching=batching), values, grads)
    if batching == "stacked":
        assert seen == [([(6, 2, 2, 2)], (1, 6, 8)), ([(5, 7), (5, 7)], (2, 5, 7))] * 2
    else:
        assert seen == [([(6, 2, 2, 2)], (1, 6, 8)), ([(5, 7)], (1, 5, 7)),
                        ([(5, 7)], (1, 5, 7))] * 2
    assert [s["calls"].item() for s in opt.state.values()] == [2, 2, 2]


@pytest.mark.parametrize("nesterov", [False, True])
def test_prepare_reads_m_tilde_and_may_write_its_scratch(nesterov):
    class Destructive(HybridOrthogonalOptimizer):
        def prepare(self, M, segment, group, out):
            found = M.clone()
            out.fill_(float("nan"))
            return found

    values, grads = params_and_grads([(5, 7), (4, 2, 3)], steps=3)
    params, opt = run(lambda ps: Destructive(ps, lr=0.1, momentum=0.9, nesterov=nesterov),
                      values, grads)
    for i, state in enumerate(opt.state.values()):
        want = torch.zeros_like(values[i])
        for step_grads in grads:
            want = 0.9 * want + 0.1 * step_grads[i]
        torch.testing.assert_close(state["momentum_buffer"], want)
        assert torch.isfinite(params[i]).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"distributed": "yes"}, "distributed"), ({"distributed": 1}, "distributed"),
     ({"batching": "batched"}, "batching"), ({"compile": "no"}, "compile")],
)
def test_bad_path_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MuonEq([nn.Parameter(torch.randn(3, 3))], **kwargs)


def test_distributed_true_without_a_process_group_is_an_error():
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="not initialized"):
        MuonEq([p], distributed=True).step()
    MuonEq([p], distributed="auto").step()  # auto: one process computes everything


@pytest.mark.slow
def test_compiled_newton_schulz_differs_only_by_rounding():
    values, grads = params_and_grads([(16, 24)], steps=2)
    eager, _ = run(lambda ps: MuonEq(ps, lr=0.05, ns_dtype="float32"), values, grads)
    compiled, _ = run(lambda ps: MuonEq(ps, lr=0.05, ns_dtype="float32", compile=True),
                      values, grads)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)


def test_benchmark_smoke_run_writes_the_table(tmp_path, capsys):
    from muoneq.suite.benchmarks.bench_step import main

    out = tmp_path / "bench.json"
    assert main(["--quick", "--sets", "gpt2_small", "--repeats", "1", "--peers", "without",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] and result["quick"] and result["peers"] == {}
    data = result["sets"]["gpt2_small"]
    names = set(data["contenders"])
    # the default ns_dtype="auto" (float32 on this CPU, or bf16 where it multiplies bf16
    # natively); a row measures the other dtype
    auto = dtype_name(resolve_dtype("auto", "cpu"))
    other = "bfloat16" if auto == "float32" else "float32"
    assert {"torch.optim.Muon", "Muon (ours)", "MuonEq-R", f"MuonEq-R ({other})", "MuonEq-C",
            "MuonEq-RC", "MuonEq-R (gram)", "paper loop (R)"} <= names
    assert data["contenders"]["MuonEq-R"]["ns_dtype"] == auto
    assert data["contenders"][f"MuonEq-R ({other})"]["ns_dtype"] == other
    for row in data["contenders"].values():
        assert row["ms"] > 0 and row["gflops"] > 0 and row["peak_extra_mb"] >= 0
        assert 0 < row["err_gaussian"] < 0.1 and 0 < row["err_decay"] < 0.5
    torch_row = data["contenders"]["torch.optim.Muon"]
    assert torch_row["vs_torch"] == 1 and torch_row["x_torch_gaussian"] == 1
    # our Muon is torch's algorithm: same direction, same state
    ours = data["contenders"]["Muon (ours)"]
    assert ours["err_gaussian"] == torch_row["err_gaussian"]
    assert ours["state_bytes"] == torch_row["state_bytes"]
    assert all(d["within_bound"] for d in data["ddp_split"].values())
    # the stacked path's default workspace within twice torch's peak, measured in the process
    workspace = data["workspace"]
    assert workspace["contender"] == "MuonEq-R (stacked)" and workspace["chunks"] > 0
    assert 0 < workspace["over_torch"] <= 2
    assert workspace["default_mb"] == data["contenders"]["MuonEq-R (stacked)"]["workspace_mb"]
    assert f"| MuonEq-R | {auto} |" in capsys.readouterr().out
    # the table as Markdown beside the JSON, headed by what ran where (commit, load)
    md = out.with_suffix(".md").read_text()
    assert md.startswith(f"# muoneq bench on {result['device_label']}\n\n{result['date']}, "
                         f"muoneq at {result['git_commit'][:10]}")
    assert "1-minute load average" in md and f"| MuonEq-R | {auto} |" in md
