"""The paper's baselines (NorMuon, AdaMuon, Muon+, Mousse, MARS-AdamW) against float64 NumPy
transcriptions of their update rules, torch.optim.AdamW, a small model, and a resume."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from muoneq import AdaMuon, MarsAdamW, Mousse, MuonPlus, NorMuon, build_optimizer, param_groups
from tests.helpers.reference import QUINTIC, ns_ref

F64 = torch.float64
NS5 = (QUINTIC,) * 5
MATRIX_BASELINES = ("normuon", "adamuon", "muon_plus", "mousse")
BASELINES = (*MATRIX_BASELINES, "mars_adamw")


# ------------------------------------------------------------- float64 transcriptions (NumPy)
def shape_factor(m, n, lr_adjust):
    return {"rms": 0.2 * np.sqrt(max(m, n)), "spectral": np.sqrt(max(1.0, m / n)),
            "spectral_unclamped": np.sqrt(m / n), "none": 1.0}[lr_adjust]


def momentum_inputs(grads, beta, nesterov):
    """The EMA momentum M_t and the matrix M̃_t fed to each method."""
    M = np.zeros_like(grads[0])
    for G in grads:
        M = beta * M + (1 - beta) * G
        yield G, (beta * M + (1 - beta) * G) if nesterov else M


def normuon_ref(X, grads, *, lr, beta, nesterov, wd, beta2, eps, lr_adjust):
    X = X.copy()
    v = np.zeros((X.shape[0], 1))
    for _, Mt in momentum_inputs(grads, beta, nesterov):
        O = ns_ref(Mt, NS5)
        v = beta2 * v + (1 - beta2) * (O**2).mean(axis=1, keepdims=True)
        Oh = O / (np.sqrt(v) + eps)
        Oh = Oh * np.linalg.norm(O) / (np.linalg.norm(Oh) + eps)
        X = (1 - lr * wd) * X - shape_factor(*X.shape, lr_adjust) * lr * Oh
    return X


def adamuon_ref(X, grads, *, lr, beta, nesterov, wd, beta2, eps, sign_momentum):
    X = X.copy()
    m, n = X.shape
    V = np.zeros_like(X)
    for t, (_, Mt) in enumerate(momentum_inputs(grads, beta, nesterov), start=1):
        O = ns_ref(np.sign(Mt) if sign_momentum else Mt, NS5)
        V = beta2 * V + (1 - beta2) * O**2
        Oh = O / (np.sqrt(V / (1 - beta2**t)) + eps)
        # the paper's RMS-aligned step: 0.2·√(mn)·Ô/‖Ô‖_F (up to ε)
        X = (1 - lr * wd) * X - lr * 0.2 * np.sqrt(m * n) * Oh / (np.linalg.norm(Oh) + eps)
    return X


def muon_plus_ref(X, grads, *, lr, beta, nesterov, wd, norm_mode, norm_eps):
    X = X.copy()
    for _, Mt in momentum_inputs(grads, beta, nesterov):
        U = ns_ref(Mt, NS5)
        for axis in {"none": (), "col": (0,), "row": (1,), "col_row": (0, 1),
                     "row_col": (1, 0)}[norm_mode]:
            U = U / np.sqrt((U**2).sum(axis=axis, keepdims=True) + norm_eps)
        X = (1 - lr * wd) * X - np.sqrt(X.shape[0] / X.shape[1]) * lr * U
    return X


def mousse_ref(X, grads, *, lr, beta, nesterov, wd, alpha, precond_beta, precond_eps,
               precond_every):
    """Whitening written as symmetric matrix powers: U = P_L·NS(P_L M̃ P_R)·P_R, P = F^(−α)."""
    X = X.copy()
    m, n = X.shape
    L, R = np.zeros((m, m)), np.zeros((n, n))
    for t, (G, Mt) in enumerate(momentum_inputs(grads, beta, nesterov), start=1):
        L = precond_beta * L + (1 - precond_beta) * G @ G.T
        R = precond_beta * R + (1 - precond_beta) * G.T @ G
        if (t - 1) % precond_every == 0:
            powers = []
            for F in (L, R):
                F = F / (1 - precond_beta**t)  # bias correction
                F = F * F.shape[0] / np.trace(F)  # trace normalization
                lam, Q = np.linalg.eigh(F + precond_eps * np.eye(F.shape[0]))
                lam = lam + max(0.0, -lam.min()) + precond_eps
                powers.append(Q @ np.diag(lam**-alpha) @ Q.T)
            P_L, P_R = powers
        O = ns_ref(P_L @ Mt @ P_R, NS5)
        U = P_L @ O @ P_R
        U = U * np.linalg.norm(O) / np.linalg.norm(U)
        X = (1 - lr * wd) * X - np.sqrt(m / n) * lr * U
    return X


def mars_ref(X, grads, *, lr, betas, eps, wd, gamma, mars):
    beta1, beta2 = betas
    X = X.copy()
    m, v, g_prev = np.zeros_like(X), np.zeros_like(X), np.zeros_like(X)
    for t, g in enumerate(grads, start=1):
        c = g + gamma * beta1 / (1 - beta1) * (g - g_prev) if mars else g
        if mars and np.linalg.norm(c) > 1:
            c = c / np.linalg.norm(c)
        g_prev = g
        m = beta1 * m + (1 - beta1) * c
        v = beta2 * v + (1 - beta2) * c**2
        X = X - lr * wd * X - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    return X


# ------------------------------------------------------------- helpers
def run_steps(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


def random_grads(shapes, steps, scale=1.0):
    return [[scale * torch.randn(s, dtype=F64) for s in shapes] for _ in range(steps)]


def as_matrix(t):
    return t.detach().reshape(t.shape[0], -1).numpy()


# A tall matrix and a conv filter (viewed as (out, in·kh·kw) = 4×12, wide).
SHAPES = [(7, 5), (4, 3, 2, 2)]

MATRIX_CASES = [
    pytest.param(NorMuon, normuon_ref, dict(beta2=0.95, eps=1e-10), dict(lr_adjust="rms"),
                 id="normuon"),
    pytest.param(NorMuon, normuon_ref, dict(beta2=0.9, eps=1e-10, nesterov=False),
                 dict(lr_adjust="spectral"), id="normuon-no-nesterov-spectral"),
    pytest.param(AdaMuon, adamuon_ref, dict(beta2=0.999, eps=1e-8, sign_momentum=True), {},
                 id="adamuon"),
    pytest.param(AdaMuon, adamuon_ref,
                 dict(beta2=0.95, eps=1e-8, sign_momentum=False, nesterov=False), {},
                 id="adamuon-no-sign-no-nesterov"),
    *[pytest.param(MuonPlus, muon_plus_ref, dict(norm_mode=mode, norm_eps=1e-8), {},
                   id=f"muon_plus-{mode}")
      for mode in ("none", "col", "row", "col_row", "row_col")],
    pytest.param(Mousse, mousse_ref, dict(alpha=0.125, precond_beta=0.95, precond_eps=1e-5,
                                          precond_every=2, nesterov=False), {},
                 id="mousse-every-2"),
    pytest.param(Mousse, mousse_ref, dict(alpha=0.25, precond_beta=0.9, precond_eps=1e-6,
                                          precond_every=1, nesterov=True), {},
                 id="mousse-every-1-nesterov"),
]


@pytest.mark.parametrize(("cls", "ref", "hparams", "ours_only"), MATRIX_CASES)
def test_matrix_baselines_match_float64_transcription(cls, ref, hparams, ours_only):
    """Four steps on a tall matrix and on a conv filter, with weight decay."""
    X0 = [torch.randn(s, dtype=F64) for s in SHAPES]
    grads = random_grads(SHAPES, 4)
    params = [nn.Parameter(x.clone()) for x in X0]
    opt = cls(params, lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float64,
              **hparams, **ours_only)
    run_steps(opt, params, grads)
    ref_kwargs = {k: v for k, v in {**hparams, **ours_only}.items() if k != "nesterov"}
    for i, (x0, p) in enumerate(zip(X0, params, strict=True)):
        expected = ref(as_matrix(x0), [as_matrix(g[i]) for g in grads], lr=0.05, beta=0.9,
                       nesterov=hparams.get("nesterov", cls is not Mousse), wd=0.1,
                       **ref_kwargs)
        np.testing.assert_allclose(as_matrix(p), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("optimize_1d", [False, True])
@pytest.mark.parametrize("gamma", [0.0, 0.025, 0.5])
def test_mars_adamw_matches_float64_transcription(gamma, optimize_1d):
    """Matrix, conv filter and bias; gradients large enough that the norm clip engages."""
    shapes = [(6, 4), (3, 2, 2, 2), (5,)]
    X0 = [torch.randn(s, dtype=F64) for s in shapes]
    grads = random_grads(shapes, 4, scale=0.6)
    params = [nn.Parameter(x.clone()) for x in X0]
    opt = MarsAdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    gamma=gamma, optimize_1d=optimize_1d)
    run_steps(opt, params, grads)
    for i, (x0, p) in enumerate(zip(X0, params, strict=True)):
        expected = mars_ref(x0.numpy(), [g[i].numpy() for g in grads], lr=0.01,
                            betas=(0.9, 0.95), eps=1e-8, wd=0.1, gamma=gamma,
                            mars=x0.ndim >= 2 or optimize_1d)
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-13)


def test_mars_adamw_with_gamma_zero_is_torch_adamw():
    """γ = 0 and gradient norms below 1 (no clipping): AdamW step for step, 1-D tensors too."""
    shapes = [(8, 5), (2, 3, 3, 3), (5,), ()]
    X0 = [torch.randn(s) for s in shapes]
    ours, theirs = ([nn.Parameter(x.clone()) for x in X0] for _ in range(2))
    opt_ours = MarsAdamW(ours, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         gamma=0.0, optimize_1d=True)
    opt_theirs = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                   weight_decay=0.1, foreach=True)
    for _ in range(6):
        grads = [torch.randn(s) for s in shapes]
        grads = [g * 0.9 / max(g.norm().item(), 1.0) for g in grads]
        for group in (ours, theirs):
            for p, g in zip(group, grads, strict=True):
                p.grad = g.clone()
        opt_ours.step()
        opt_theirs.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mars_clip_and_first_step():
    """c₁ = (1 + γβ₁/(1−β₁))·g₁ (g₀ = 0), scaled to norm 1: Adam's first step is then
    −η·sign(c₁) whatever the scale, and ``last_grad`` holds g₁."""
    p = nn.Parameter(torch.zeros(3, 4, dtype=F64))
    g = torch.randn(3, 4, dtype=F64) * 10
    opt = MarsAdamW([p], lr=0.1, eps=0.0, weight_decay=0.0, gamma=0.025)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), -0.1 * g.sign())
    torch.testing.assert_close(opt.state[p]["last_grad"], g)
    c1 = g * (1 + 0.025 * 0.9 / 0.1)
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.1 * c1 / c1.norm())


# ------------------------------------------------------------- a small model trains
class MLP(nn.Module):
    """Two layers: ``hidden`` goes to the matrix path, ``head`` and biases to AdamW."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(16, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


def regression_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g)) + 0.5 * x[:, :1]
    return x, y


LR = {"normuon": 0.03, "adamuon": 0.03, "muon_plus": 0.05, "mousse": 0.05, "mars_adamw": 0.03}


@pytest.mark.parametrize("name", BASELINES)
def test_small_model_trains(name):
    model = MLP()
    x, y = regression_batch()
    opt = build_optimizer(name, model, lr=LR[name], weight_decay=0.0)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(30)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", MATRIX_BASELINES)
def test_build_by_name_routes_a_model(name):
    model = MLP()
    opt = build_optimizer(name, model, lr=0.01)
    matrix, adamw = opt.param_groups
    assert matrix["use_muon"] and matrix["params"] == [model.hidden.weight]
    assert not adamw["use_muon"] and len(adamw["params"]) == 3


def test_build_by_name_presets_and_explicit_groups():
    model = MLP()
    muon_plus = build_optimizer("muon_plus", model).param_groups[0]
    assert (muon_plus["norm_mode"], muon_plus["lr_adjust"]) == ("col_row", "spectral_unclamped")
    assert build_optimizer("mars_adamw", model).param_groups[0]["gamma"] == 0.025
    assert build_optimizer("mousse", model).param_groups[0]["precond_every"] == 10
    groups = [{"params": [model.hidden.weight], "use_muon": True, "lr": 0.02},
              {"params": [model.hidden.bias], "use_muon": False}]
    opt = build_optimizer("normuon", groups, lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.01]
    mars = build_optimizer("mars_adamw", [model.hidden.weight], lr=0.02)
    assert isinstance(mars, MarsAdamW) and mars.param_groups[0]["lr"] == 0.02


# ------------------------------------------------------------- stopping and resuming
def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", BASELINES)
def test_state_dict_round_trip_continues_identically(name):
    hparams = {"precond_every": 2} if name == "mousse" else {}
    x, y = regression_batch()

    def make(model):
        params = model if name == "mars_adamw" else param_groups(model)
        return build_optimizer(name, params, lr=0.01, **hparams)

    model = MLP()
    opt = make(model)
    train(model, opt, x, y, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, x, y, 3)

    resumed = MLP()
    resumed.load_state_dict(saved_model)
    opt2 = make(resumed)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, x, y, 3)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mousse_keeps_float32_curvature_for_bf16_parameters():
    p = nn.Parameter(torch.randn(6, 4).bfloat16())
    opt = Mousse([p], lr=0.01)
    p.grad = torch.randn(6, 4).bfloat16()
    opt.step()
    opt2 = Mousse([p], lr=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for key in ("L", "R", "Q_L", "Q_R", "lambda_L", "lambda_R"):
        assert opt2.state[p][key].dtype == torch.float32
        assert torch.equal(opt2.state[p][key], opt.state[p][key])
    assert opt2.state[p]["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", MATRIX_BASELINES)
def test_state_is_created_up_front(name):
    model = MLP()
    opt = build_optimizer(name, model)
    keys = {
        "normuon": {"momentum_buffer", "second_moment"},
        "adamuon": {"momentum_buffer", "exp_avg_sq", "step"},
        "muon_plus": {"momentum_buffer"},
        "mousse": {"momentum_buffer", "step", "L", "R", "Q_L", "Q_R", "lambda_L", "lambda_R"},
    }[name]
    assert set(opt.state[model.hidden.weight]) == keys
    assert set(opt.state[model.head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


# ------------------------------------------------------------- edge cases and bad input
@pytest.mark.parametrize("name", BASELINES)
def test_zero_gradients_give_zero_update(name):
    extra = {"norm_eps": 0.0} if name == "muon_plus" else {}
    W = nn.Parameter(torch.randn(5, 3))
    opt = build_optimizer(name, [W], lr=0.1, weight_decay=0.0, **extra)
    before = W.detach().clone()
    for _ in range(2):
        W.grad = torch.zeros_like(W)
        opt.step()
    assert torch.equal(W.detach(), before)


BAD = [
    ("normuon", {"beta2": 1.0}, "beta2"),
    ("normuon", {"eps": -1e-10}, "eps"),
    ("adamuon", {"beta2": -0.1}, "beta2"),
    ("adamuon", {"eps": -1.0}, "eps"),
    ("adamuon", {"sign_momentum": "yes"}, "sign_momentum"),
    ("muon_plus", {"norm_mode": "diag"}, "norm_mode"),
    ("muon_plus", {"norm_eps": -1.0}, "norm_eps"),
    ("mousse", {"precond_every": 0}, "precond_every"),
    ("mousse", {"precond_every": 2.5}, "precond_every"),
    ("mousse", {"alpha": -0.5}, "alpha"),
    ("mousse", {"precond_beta": 1.0}, "precond_beta"),
    ("mousse", {"precond_eps": -1e-5}, "precond_eps"),
    ("mousse", {"momentum": 1.0}, "momentum"),
    ("mars_adamw", {"lr": -1.0}, "lr"),
    ("mars_adamw", {"betas": (0.9, 1.0)}, r"betas\[1\]"),
    ("mars_adamw", {"betas": (0.9,)}, "betas"),
    ("mars_adamw", {"eps": -1e-8}, "eps"),
    ("mars_adamw", {"weight_decay": -0.1}, "weight_decay"),
    ("mars_adamw", {"gamma": -0.025}, "gamma"),
    ("mars_adamw", {"gamma": float("nan")}, "gamma"),
    ("mars_adamw", {"optimize_1d": "no"}, "optimize_1d"),
]


@pytest.mark.parametrize(("name", "hparams", "field"), BAD)
def test_bad_hyper_parameters_raise_naming_the_field(name, hparams, field):
    with pytest.raises(ValueError, match=field):
        build_optimizer(name, MLP(), **hparams)


def test_allowed_values_are_listed():
    with pytest.raises(ValueError, match="none, col, row, col_row, row_col"):
        MuonPlus([nn.Parameter(torch.randn(3, 3))], norm_mode="rows")


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon, MuonPlus, Mousse])
def test_vectors_in_a_matrix_group_raise(cls):
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        cls([nn.Parameter(torch.randn(4))])


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon, MuonPlus, Mousse])
def test_unknown_hyper_parameter_raises(cls):
    with pytest.raises(TypeError):
        cls([nn.Parameter(torch.randn(4, 4))], mode="R")


def test_mars_rejects_sparse_gradients():
    p = nn.Parameter(torch.randn(4, 3))
    opt = MarsAdamW([p])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
