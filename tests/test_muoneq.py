"""MuonEq against the paper's equations, torch.optim.Muon and torch.optim.AdamW."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from muoneq import MuonEq, muoneq_update
from muoneq.functional import lr_scale, update_parameter
from muoneq.newton_schulz import dtype_name, ns_flops, resolve_dtype
from tests.helpers.reference import QUINTIC, muoneq_ref

F64 = torch.float64


def run_steps(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("mode", ["none", "R", "C", "RC"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(12, 7), (6, 10)])
def test_matches_float64_transcription(mode, nesterov, wd, shape):
    X0 = torch.randn(shape, dtype=F64)
    grads = [torch.randn(shape, dtype=F64) * (1 + torch.arange(shape[0], dtype=F64))[:, None]
             for _ in range(4)]
    p = nn.Parameter(X0.clone())
    opt = MuonEq([p], lr=0.03, momentum=0.9, nesterov=nesterov, mode=mode, eps=1e-8,
                 weight_decay=wd, ns_dtype=torch.float64)
    run_steps(opt, [p], [[g] for g in grads])
    expected = muoneq_ref(X0.numpy(), [g.numpy() for g in grads], lr=0.03, beta=0.9,
                          nesterov=nesterov, mode=mode, eps=1e-8, wd=wd)
    np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["none", "R", "C", "RC"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", [(12, 7), (6, 10)])
def test_functional_core_matches_float64_transcription(mode, nesterov, shape):
    """Algorithm 1 written with the public functions (muoneq_update, update_parameter)."""
    X0 = torch.randn(shape, dtype=F64)
    grads = [torch.randn(shape, dtype=F64) * (1 + torch.arange(shape[0], dtype=F64))[:, None]
             for _ in range(4)]
    X, M = X0.clone(), torch.zeros(shape, dtype=F64)
    for G in grads:
        O = muoneq_update(G, M, beta=0.9, nesterov=nesterov, mode=mode, eps=1e-8,
                          ns_dtype=torch.float64)
        update_parameter(X, O, lr=0.03, weight_decay=0.1, scale=lr_scale(shape, "rms"))
    expected = muoneq_ref(X0.numpy(), [g.numpy() for g in grads], lr=0.03, beta=0.9,
                          nesterov=nesterov, mode=mode, eps=1e-8, wd=0.1)
    np.testing.assert_allclose(X.numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["none", "R", "RC"])
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_gram_order_matches_float64_transcription(mode, shape):
    X0 = torch.randn(shape, dtype=F64)
    grads = [torch.randn(shape, dtype=F64) for _ in range(3)]
    p = nn.Parameter(X0.clone())
    opt = MuonEq([p], lr=0.03, momentum=0.9, mode=mode, ns_dtype="float64", ns_algorithm="Gram")
    assert opt.param_groups[0]["ns_algorithm"] == "gram"
    run_steps(opt, [p], [[g] for g in grads])
    expected = muoneq_ref(X0.numpy(), [g.numpy() for g in grads], lr=0.03, beta=0.9,
                          nesterov=True, mode=mode, eps=1e-8, wd=0.1)
    np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-12)
    gram, standard = (ns_flops(shape, opt.param_groups[0]["ns_steps"], a)
                      for a in ("gram", "standard"))
    assert gram < standard


@pytest.mark.parametrize("lr_adjust", ["rms", "spectral", "none"])
def test_conv_filters_are_orthogonalized_as_out_by_in_k_k(lr_adjust):
    X0 = torch.randn(8, 3, 3, 3, dtype=F64)
    grads = [torch.randn_like(X0) for _ in range(3)]
    p = nn.Parameter(X0.clone())
    opt = MuonEq([p], lr=0.05, momentum=0.9, mode="RC", ns_dtype="float64", weight_decay=0.1,
                 lr_adjust=lr_adjust)
    run_steps(opt, [p], [[g] for g in grads])
    expected = muoneq_ref(X0.reshape(8, 27).numpy(), [g.reshape(8, 27).numpy() for g in grads],
                          lr=0.05, beta=0.9, nesterov=True, mode="RC", eps=1e-8, wd=0.1,
                          scale=lr_adjust)
    np.testing.assert_allclose(p.detach().reshape(8, 27).numpy(), expected, rtol=1e-10)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", [(64, 32), (32, 96)])
def test_mode_none_is_torch_muon_match_rms_adamw(nesterov, shape):
    X0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(5)]
    ours, theirs = nn.Parameter(X0.clone()), nn.Parameter(X0.clone())
    opt_ours = MuonEq([ours], lr=0.02, momentum=0.95, nesterov=nesterov, mode="none",
                      weight_decay=0.1, lr_adjust="rms", ns_dtype="bfloat16")
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, momentum=0.95, nesterov=nesterov,
                                  weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    run_steps(opt_ours, [ours], [[g] for g in grads])
    run_steps(opt_theirs, [theirs], [[g] for g in grads])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_adamw_groups_match_torch_adamw():
    shapes = [(5,), (7, 3), (2, 3, 4), ()]
    init = [torch.randn(s) for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in init]
    theirs = [nn.Parameter(t.clone()) for t in init]
    opt_ours = MuonEq([{"params": ours, "use_muon": False}], lr=3e-3, weight_decay=0.05,
                      adamw_betas=(0.8, 0.99), adamw_eps=1e-6)
    opt_theirs = torch.optim.AdamW(theirs, lr=3e-3, weight_decay=0.05, betas=(0.8, 0.99),
                                   eps=1e-6, foreach=True)
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]
    run_steps(opt_ours, ours, grads)
    run_steps(opt_theirs, theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _row_scaled_direction(mode, scale_rows=None, scale_cols=None, factor=1.0):
    torch.manual_seed(1)
    G = torch.randn(10, 6, dtype=F64)
    if scale_rows is not None:
        G = G * scale_rows[:, None]
    if scale_cols is not None:
        G = G * scale_cols[None, :]
    p = nn.Parameter(torch.zeros(10, 6, dtype=F64))
    opt = MuonEq([p], lr=1.0, momentum=0.0, nesterov=False, mode=mode, eps=0.0,
                 weight_decay=0.0, ns_dtype=F64, lr_adjust="none")
    p.grad = G * factor
    opt.step()
    return -p.detach()


def test_invariances():
    rows = torch.rand(10, dtype=F64) * 100 + 0.01
    cols = torch.rand(6, dtype=F64) * 100 + 0.01
    torch.testing.assert_close(_row_scaled_direction("R", scale_rows=rows),
                               _row_scaled_direction("R"))
    torch.testing.assert_close(_row_scaled_direction("C", scale_cols=cols),
                               _row_scaled_direction("C"))
    for mode in ["none", "R", "C", "RC"]:
        torch.testing.assert_close(_row_scaled_direction(mode, factor=1e-4),
                                   _row_scaled_direction(mode))
    # and the scaling does matter without equilibration: the test can fail
    assert not torch.allclose(_row_scaled_direction("none", scale_rows=rows),
                              _row_scaled_direction("none"))


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    model = nn.Linear(4, 3, bias=False)
    opt = MuonEq(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    before = model.weight.detach().clone()
    with torch.no_grad():
        loss = opt.step(closure)
    assert calls == [True]
    assert loss.item() > 0
    assert not torch.equal(before, model.weight)


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 6, generator=gen)
        y = torch.randn(32, 3, generator=gen)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _groups(model):
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, nn.Linear)]
    return [{"params": weights}, {"params": biases, "use_muon": False}]


def test_state_dict_round_trip_resumes_the_same_trajectory():
    straight = _model()
    opt = MuonEq(_groups(straight), lr=0.02, mode="RC")
    _train(straight, opt, 3, seed=0)
    saved_model = copy.deepcopy(straight.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(straight, opt, 4, seed=1)

    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = MuonEq(_groups(resumed), lr=0.02, mode="RC")
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, 4, seed=1)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoints_written_before_a_group_key_existed_still_load():
    model = _model()
    opt = MuonEq(_groups(model), lr=0.02)
    _train(model, opt, 1, seed=0)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        del group["ns_algorithm"]  # a key added after the checkpoint was written
    opt2 = MuonEq(_groups(model), lr=0.02)
    opt2.load_state_dict(old)
    assert [g["ns_algorithm"] for g in opt2.param_groups] == ["standard", "standard"]
    _train(model, opt2, 1, seed=1)


def test_persistent_state_is_one_buffer_per_matrix_and_two_moments_per_adamw_param():
    model = _model()
    opt = MuonEq(_groups(model), lr=0.02)
    _train(model, opt, 2, seed=0)
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if group["use_muon"]:
                assert set(state) == {"momentum_buffer"}
                assert state["momentum_buffer"].shape == p.shape
            else:
                assert set(state) == {"step", "exp_avg", "exp_avg_sq"}


def test_training_decreases_the_loss():
    model = _model()
    opt = MuonEq(_groups(model), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen)
    y = torch.tanh(x @ torch.randn(6, 8, generator=gen)) @ torch.randn(8, 3, generator=gen)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("mode", ["none", "R", "C", "RC"])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_zero_gradient_gives_zero_update(mode, eps):
    p = nn.Parameter(torch.randn(5, 4))
    before = p.detach().clone()
    opt = MuonEq([p], lr=0.1, mode=mode, eps=eps, weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p, before)


def test_zero_rows_and_columns_stay_zero_with_eps_zero():
    G = torch.randn(6, 5, dtype=F64)
    G[2] = 0
    G[:, 3] = 0
    p = nn.Parameter(torch.zeros(6, 5, dtype=F64))
    opt = MuonEq([p], lr=1.0, momentum=0.0, nesterov=False, mode="RC", eps=0.0,
                 weight_decay=0.0, ns_dtype=F64)
    p.grad = G
    opt.step()
    assert torch.isfinite(p).all()
    assert torch.equal(p[2], torch.zeros(5, dtype=F64))
    assert torch.equal(p[:, 3], torch.zeros(6, dtype=F64))


def test_mode_spellings_are_case_insensitive():
    p = nn.Parameter(torch.randn(3, 3))
    for spelling, canonical in [("r", "R"), ("row", "R"), ("Col", "C"), ("rowcol", "RC"),
                                ("rc", "RC"), ("NONE", "none")]:
        assert MuonEq([p], mode=spelling).param_groups[0]["mode"] == canonical


def test_ns_dtype_names_and_explicit_coefficients():
    p = nn.Parameter(torch.randn(4, 3))
    opt = MuonEq([p], ns_dtype="float32", ns_coefficients=[QUINTIC] * 5)
    assert opt.param_groups[0]["ns_dtype"] == "float32"
    assert opt.param_groups[0]["ns_coefficients"] == (QUINTIC,) * 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": -1.0}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"mode": "diag"}, "mode"),
        ({"ns_coefficients": "cubic"}, "ns_coefficients"),
        ({"ns_coefficients": [QUINTIC] * 3}, "ns_coefficients"),
        ({"lr_adjust": "moonlight"}, "lr_adjust"),
        ({"ns_steps": -1}, "ns_steps"),
        ({"ns_steps": 2.5}, "ns_steps"),
        ({"ns_dtype": "int8"}, "ns_dtype"),
        ({"ns_algorithm": "fast"}, "ns_algorithm"),
        ({"adamw_betas": (0.9, 1.0)}, "adamw_betas"),
    ],
)
def test_bad_hyper_parameters_name_the_field(kwargs, field):
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match=field):
        MuonEq([p], **kwargs)


def test_bad_values_in_a_param_group_are_rejected_too():
    p, q = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3, 3))
    opt = MuonEq([p])
    with pytest.raises(ValueError, match="mode"):
        opt.add_param_group({"params": [q], "mode": "X"})
    assert len(opt.param_groups) == 1


def test_allowed_values_are_listed():
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match="RC"):
        MuonEq([p], mode="diag")
    with pytest.raises(ValueError, match="polar_express"):
        MuonEq([p], ns_coefficients="cubic")


@pytest.mark.parametrize("shape", [(), (7,)])
def test_vectors_in_a_matrix_group_are_an_error_naming_the_shape(shape):
    with pytest.raises(ValueError, match=str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
        MuonEq([nn.Parameter(torch.randn(shape))])


def test_optimizer_state_round_trips_through_torch_distributed_checkpoint(tmp_path):
    """FSDP2 checkpoints go through DCP; param groups hold only plain values (dtype by name)."""
    import torch.distributed.checkpoint as dcp

    model = _model()
    opt = MuonEq(_groups(model), lr=0.02, ns_dtype=torch.float32)
    _train(model, opt, 2, seed=0)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path / "ckpt")
    fresh = MuonEq(_groups(model), lr=0.02, ns_dtype=torch.float32)
    loaded = {"optim": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    fresh.load_state_dict(loaded["optim"])
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(fresh.state[p][key], value)
    assert fresh.param_groups[0]["ns_dtype"] == "float32"


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_ns_dtype_is_bfloat16_on_accelerators_and_cpus_that_multiply_it(native_bf16,
                                                                             monkeypatch):
    """bf16 where the hardware multiplies it (accelerators; CPUs with AVX512-BF16 or AMX),
    float32 on other CPUs."""
    monkeypatch.setitem(resolve_dtype.__globals__, "cpu_has_native_bf16", lambda: native_bf16)
    auto = torch.bfloat16 if native_bf16 else torch.float32
    assert resolve_dtype("auto", "cpu") is auto
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    with pytest.raises(ValueError, match="ns_dtype: unknown dtype 'auto'; allowed: float64"):
        resolve_dtype("auto")  # no device to decide for
    X0, grads = torch.randn(24, 40), [torch.randn(24, 40) for _ in range(3)]
    params = {}
    for dtype in ("auto", "float32", "bfloat16"):
        params[dtype] = nn.Parameter(X0.clone())
        run_steps(MuonEq([params[dtype]], lr=0.02, ns_dtype=dtype), [params[dtype]],
                  [[g] for g in grads])
    assert torch.equal(params["auto"], params[dtype_name(auto)])
    assert not torch.equal(params["float32"], params["bfloat16"])
