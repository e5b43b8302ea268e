"""The ``torch.optim`` contract, checked for every optimizer ``build_optimizer`` knows.

Modelled on PyTorch's own generic optimizer tests (``TestOptimRenewed`` in pytorch's
``test/test_optim.py``, parametrized over ``OptimizerInfo`` entries of
``torch.testing._internal.common_optimizers``), written for this package: each *case* is one
optimizer on one of its paths — the matrix (orthogonalized) path and the AdamW path of every
hybrid optimizer, MARS-AdamW with and without its 1-D correction, the SGD/AdamW passthroughs
— and ``torch.optim.Muon`` / ``torch.optim.AdamW`` run through the same tests as controls.

A test hands the optimizer tensors, ``(name, tensor)`` pairs or param-group dicts exactly as
torch's tests do; :func:`route` turns them into the groups of the case's path (on the matrix
path, ≥2-D tensors go to a ``use_muon=True`` group and the rest to a ``use_muon=False`` group
with the same options, as :func:`muoneq.param_groups` routes a model).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from muoneq import OPTIMIZERS, build_optimizer
from muoneq.optim import signature

LR = 1e-2
pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------- the cases


def _tensor(item) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item


def route(params, path: str) -> list[dict] | None:
    """The param groups of ``path`` for what a test passes (tensors, named pairs or groups;
    ``None`` is passed on, as torch's error tests pass it)."""
    if params is None:
        return None
    items = list(params) if not isinstance(params, torch.Tensor) else [params]
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    routed = []
    for group in groups:
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        options = {k: v for k, v in group.items() if k != "params"}
        matrices = [m for m in members if _tensor(m).ndim >= 2]
        others = [m for m in members if _tensor(m).ndim < 2]
        if path == "matrix":
            parts = [(matrices, {"use_muon": True}), (others, {"use_muon": False})]
        elif path == "adamw":
            parts = [(members, {"use_muon": False})]
        elif path == "matrix_only":  # torch.optim.Muon takes 2-D tensors only
            parts = [(matrices, {})]
        else:
            parts = [(members, {})]
        routed += [{**options, **extra, "params": part} for part, extra in parts if part]
    return routed


@dataclass(frozen=True)
class Case:
    """One optimizer on one path, and what the contract tests need to know about it."""

    id: str
    factory: Callable  # (params, **hparams) -> Optimizer
    path: str  # "matrix" | "adamw" | "matrix_only" | "all"
    hparams: dict = field(default_factory=dict)
    ours: bool = True  # built by this package (checked for its own extensions too)
    supports_complex: bool = False
    supports_sparse: bool = False

    def make(self, params, **overrides):
        return self.factory(route(params, self.path), **{**self.hparams, **overrides})


def _registry_case(name: str, path: str, **hparams) -> Case:
    spec = OPTIMIZERS[name]
    label = "-".join([name, *(f"{k}={v}" for k, v in hparams.items()), path])
    # AdamW-path groups take complex tensors as torch.optim.AdamW does (their real view);
    # MARS-AdamW's per-tensor correction depends on the number of dimensions, so it raises
    complex_ok = path == "adamw" or name == "adamw"
    return Case(label, lambda p, **kw: build_optimizer(name, p, **kw), path,
                {"lr": LR, **hparams}, ours=spec.hybrid or name == "mars_adamw",
                supports_complex=complex_ok)


def _stacked_case(name: str, **hparams) -> Case:
    """A registered optimizer on its stacked path, every optimizer the tests build from it
    included."""
    case = _registry_case(name, "matrix", **hparams)
    return replace(case, id=case.id.replace("-matrix", "-batching=stacked-matrix"),
                   factory=lambda p, **kw: build_optimizer(name, p, batching="stacked", **kw))


HYBRID = [name for name, spec in OPTIMIZERS.items() if spec.hybrid]
CASES = [
    *[_registry_case(name, path) for name in HYBRID for path in ("matrix", "adamw")],
    *[_registry_case("muoneq_nes", "matrix", mode=mode) for mode in ("C", "RC")],
    _registry_case("muoneq_nes", "matrix", ns_algorithm="gram"),
    # the planned stacked path (the accelerator default), on CPU
    *[_stacked_case(name) for name in ("muon", "muoneq_nes", "normuon", "muon_plus", "adamuon",
                                       "mousse")],
    _stacked_case("muoneq_nes", mode="RC"),
    _registry_case("mars_adamw", "all"),
    _registry_case("mars_adamw", "all", optimize_1d=True),
    Case("sgd-momentum=0.9-all", lambda p, **kw: build_optimizer("sgd", p, **kw), "all",
         {"lr": LR, "momentum": 0.9}, ours=False, supports_complex=True, supports_sparse=True),
    _registry_case("adamw", "all"),
    Case("torch.optim.Muon", torch.optim.Muon, "matrix_only",
         {"lr": LR, "adjust_lr_fn": "match_rms_adamw"}, ours=False),
    Case("torch.optim.AdamW", torch.optim.AdamW, "all", {"lr": LR}, ours=False,
         supports_complex=True),
]
OURS = [c for c in CASES if c.ours]
HYBRID_CASES = [c for c in OURS if c.id.split("-")[0] in HYBRID]
parametrize = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
parametrize_ours = pytest.mark.parametrize("case", OURS, ids=lambda c: c.id)
parametrize_hybrid = pytest.mark.parametrize("case", HYBRID_CASES, ids=lambda c: c.id)


def test_every_registered_optimizer_has_a_case():
    covered = {c.id.split("-")[0] for c in CASES}
    assert set(OPTIMIZERS) <= covered
    assert {c.path for c in CASES if c.id.split("-")[0] in HYBRID} == {"matrix", "adamw"}


# ---------------------------------------------------------------------------- helpers


def weight_bias(contiguous: bool = True, dtype=torch.float32):
    if contiguous:
        return nn.Parameter(torch.randn(10, 5, dtype=dtype)), nn.Parameter(torch.randn(10))
    return (nn.Parameter(torch.randn(10, 5, 2, dtype=dtype)[..., 0]),
            nn.Parameter(torch.randn(10, 2)[..., 0]))


def optimized(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def loss_of(weight, bias, x):
    return (weight.mv(x) + bias).pow(2).sum()


def closure_for(opt, weight, bias, x):
    def closure():
        opt.zero_grad()
        loss = loss_of(weight, bias, x)
        loss.backward()
        return loss
    return closure


def clones(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def same_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def assert_equal_nested(actual, expected, where: str = "state_dict"):
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for key in expected:
            assert_equal_nested(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_equal_nested(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------- descent


@parametrize
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("scheduler", [None, StepLR, ReduceLROnPlateau])
def test_goes_right_direction(case, contiguous, scheduler):
    weight, bias = weight_bias(contiguous)
    x = torch.randn(5)
    opt = case.make([weight, bias])
    sched = None
    if scheduler is StepLR:
        sched = StepLR(opt, step_size=10, gamma=0.9)
    elif scheduler is ReduceLROnPlateau:
        sched = ReduceLROnPlateau(opt)
    closure = closure_for(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        loss = closure()
        opt.step()
        if sched is not None:
            sched.step(loss.item()) if isinstance(sched, ReduceLROnPlateau) else sched.step()
    assert closure().item() < initial


@parametrize
def test_param_group_with_lr_scheduler_goes_right_direction(case):
    w1, w2 = nn.Parameter(torch.randn(10, 5)), nn.Parameter(torch.randn(10, 5))
    x = torch.randn(5)
    opt = case.make([{"params": [w1]}, {"params": [w2], "lr": 0.005}])
    sched = StepLR(opt, step_size=5, gamma=0.5)

    def closure():
        opt.zero_grad()
        loss = (w1.mv(x) + w2.mv(x)).pow(2).sum()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
        sched.step()
    assert closure().item() < initial
    assert [g["lr"] for g in opt.param_groups][-1] == pytest.approx(0.005 * 0.5**4)


# ---------------------------------------------------------------------------- tensor lr


@parametrize
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "[1]", "[1,1]"])
def test_tensor_lr_of_any_one_element_shape_equals_float_lr(case, shape):
    weight, bias = weight_bias()
    x = torch.randn(5)
    float_opt = case.make([weight, bias], lr=1e-3)
    weight_c, bias_c = clones([weight, bias])
    tensor_opt = case.make([weight_c, bias_c], lr=torch.tensor(1e-3).reshape(shape))
    for _ in range(5):
        closure_for(float_opt, weight, bias, x)()
        float_opt.step()
        closure_for(tensor_opt, weight_c, bias_c, x)()
        tensor_opt.step()
    torch.testing.assert_close(optimized(tensor_opt), optimized(float_opt))


@parametrize_ours
def test_tensor_lr_must_have_one_element(case):
    weight, bias = weight_bias()
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        case.make([weight, bias], lr=torch.tensor([1e-3, 1e-3]))
    opt = case.make([weight])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        opt.add_param_group(route([{"params": [bias], "lr": torch.ones(2)}], case.path)[0])


# ---------------------------------------------------------------------------- errors


@parametrize
def test_generic_errors(case):
    a, b = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2, 3))
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        case.factory(a, **case.hparams)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        case.make([a, a])
    with pytest.raises(ValueError, match="more than one parameter group"):
        case.make([{"params": [a]}, {"params": [a]}])
    with pytest.raises(ValueError, match="with/without names"):
        case.make([("weight", a), b])


def _torch_error_inputs():
    """The cases of torch's ``TestOptimRenewed.test_errors``, as
    ``torch.testing._internal.common_optimizers.get_error_inputs_for_all_optims`` lists them on
    CPU (copied: importing that module needs torch's test-only dependencies): ``(desc, params,
    kwargs, error type, message regex)``."""
    p, q = nn.Parameter(torch.randn(1, 1)), nn.Parameter(torch.randn(1, 1))
    return [
        ("invalid param type", p, {}, TypeError,
         "params argument given to the optimizer should be an iterable of Tensors or dicts"),
        ("a param group cannot have duplicate parameters", [p, p], {}, UserWarning,
         ".*a parameter group with duplicate parameters.*"),
        ("duplicate parameters should not occur across param groups either",
         [{"params": p}, {"params": p}], {}, ValueError,
         "some parameters appear in more than one parameter group"),
        ("Tensor lr must be 1-element", None, {"lr": torch.tensor([0.001, 0.001])}, ValueError,
         "Tensor lr must be 1-element"),
        ("all optimizer params should be with/without names", [("weight", p), q], {},
         ValueError,
         "all optimizer params should be with/without names. Some param names are missing"),
        ("all optimizer param groups should be with/without names.",
         [{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}], {}, ValueError,
         "all optimizer param groups should be with/without names. "
         "cannot add param group with names to the optimizer"),
    ]


@parametrize
@pytest.mark.parametrize("error", _torch_error_inputs(), ids=lambda e: e[0])
def test_torch_error_inputs(case, error):
    """torch's own error cases: hyper-parameters are checked before ``params`` (``params=None``
    with a 2-element tensor lr), and the messages are torch's."""
    _, params, kwargs, error_type, regex = error
    expect = pytest.warns if issubclass(error_type, Warning) else pytest.raises
    with expect(error_type, match=regex):
        if isinstance(params, torch.Tensor):  # handed over as it is, not routed
            case.factory(params, **{**case.hparams, **kwargs})
        else:
            case.make(params, **kwargs)


TYPOS = [("momentun", "momentum"), ("betas", "adamw_betas"), ("compil", "compile"),
         ("distribute", "distributed"), ("batchng", "batching"), ("proces_group", "process_group"),
         ("gama", "gamma"), ("beta", "betas"), ("nesterof", "nesterov"), ("ns_step", "ns_steps")]


@parametrize_ours
def test_a_misspelled_keyword_gets_did_you_mean_over_every_accepted_name(case):
    weight = nn.Parameter(torch.randn(2, 2))
    accepted = list(signature(type(case.make([weight]))).parameters)[1:]
    checked = [(typo, meant) for typo, meant in TYPOS if meant in accepted]
    assert len(checked) >= 2
    for typo, meant in checked:
        with pytest.raises(TypeError) as caught:
            case.make([weight], **{typo: 1})
        assert str(caught.value).startswith(
            f"{type(case.make([weight])).__name__}() got an unexpected keyword argument "
            f"{typo!r}; did you mean {meant!r}? (allowed: ")
        assert str(caught.value).endswith(f"{', '.join(accepted)})")


@parametrize_hybrid
def test_ns_steps_below_one_is_refused_on_the_matrix_path(case):
    weight, bias = weight_bias()
    if case.path == "matrix":
        with pytest.raises(ValueError, match=r"^ns_steps: expected an integer ≥ 1, got 0$"):
            case.make([weight, bias], ns_steps=0)
        with pytest.raises(ValueError, match=r"^ns_steps: expected an integer ≥ 1, got -1$"):
            case.make([{"params": [weight], "ns_steps": -1}])


@parametrize_hybrid
def test_a_refused_matrix_parameter_is_named_when_names_are_given(case):
    if case.path != "matrix":
        return
    factory = type(case.make([nn.Parameter(torch.randn(2, 2))]))
    bias = nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match=r"^\w+: 'decoder.bias' \(shape \(10,\)\) is in a "
                                         r"matrix \(use_muon=True\) group"):
        factory([{"params": [("decoder.bias", bias)], "use_muon": True}])
    with pytest.raises(ValueError, match=r"a parameter of shape \(10,\) is in a matrix"):
        factory([{"params": [bias], "use_muon": True}])
    qkv = nn.Parameter(torch.randn(12, 4))
    with pytest.raises(ValueError, match=r"^splits: .* \(parameter 'attn.qkv.weight'\)$"):
        factory([{"params": [("attn.qkv.weight", qkv)], "splits": (4, 4, 5)}])


@parametrize
def test_complex_parameters(case):
    """Element-wise paths treat a complex tensor as its real view (as torch.optim.AdamW);
    orthogonalized updates of complex matrices are undefined here, so they raise."""
    params = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
              torch.randn(10, dtype=torch.complex64, requires_grad=True),
              torch.randn(10, 5, requires_grad=True)]
    if not case.supports_complex:
        with pytest.raises((ValueError, RuntimeError), match="complex"):
            opt = case.make(params)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        return
    real = [torch.view_as_real(p).detach().clone().requires_grad_() if p.is_complex()
            else p.detach().clone().requires_grad_() for p in params]
    complex_opt, real_opt = case.make(params), case.make(real)
    for _ in range(3):
        for p, r in zip(params, real, strict=True):
            r.grad = torch.randn_like(r)
            p.grad = torch.view_as_complex(r.grad) if p.is_complex() else r.grad.clone()
        complex_opt.step()
        real_opt.step()
    as_real = [torch.view_as_real(p) if p.is_complex() else p for p in params]
    torch.testing.assert_close(as_real, real)


@parametrize
def test_sparse_gradients_raise_unless_supported(case):
    weight = nn.Parameter(torch.randn(10, 5))
    opt = case.make([weight])
    weight.grad = torch.randn(10, 5).to_sparse()
    if case.supports_sparse:
        opt.step()
        return
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@parametrize_ours
@pytest.mark.parametrize("flag", ["foreach", "fused", "capturable", "differentiable", "maximize"])
def test_unsupported_torch_flags_raise(case, flag):
    weight, bias = weight_bias()
    if flag in signature(type(case.make([weight]))).parameters:
        pytest.skip(f"{flag} is supported (tests/test_capturable.py)")
    with pytest.raises(TypeError, match=flag):
        case.make([weight, bias], **{flag: True})
    with pytest.raises(ValueError, match=f"{flag}.*not supported"):
        case.make([{"params": [weight, bias], flag: True}])


# ---------------------------------------------------------------------------- param groups


@parametrize
def test_param_groups_weight_decay(case):
    weight, bias = weight_bias()
    x = torch.randn(5)
    opt = case.make([{"params": [weight], "weight_decay": 0.1},
                     {"params": [bias], "weight_decay": 0.0}])
    closure = closure_for(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        closure()
        opt.step()
    assert closure().item() < initial


@parametrize
def test_param_groups_lr(case):
    weight, bias = weight_bias()
    irrelevant = nn.Parameter(torch.randn(2, 3))
    before = irrelevant.detach().clone()
    x = torch.randn(5)
    opt = case.make([{"params": [weight, bias], "lr": LR}, {"params": [irrelevant]}],
                    lr=1e-28)
    closure = closure_for(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        closure()
        irrelevant.grad = torch.rand_like(irrelevant)
        opt.step()
    assert closure().item() < initial
    assert torch.equal(irrelevant, before)


@parametrize
def test_changing_lr_and_weight_decay_in_param_groups_takes_effect(case):
    """One more step from the same state: twice the lr moves twice as far (weight decay off),
    and turning weight decay λ on moves the parameters by a further −lr·λ·X."""
    weight, bias = weight_bias()
    x = torch.randn(5)
    opt = case.make([weight, bias], weight_decay=0.0)
    for _ in range(3):
        closure_for(opt, weight, bias, x)()
        opt.step()
    closure_for(opt, weight, bias, x)()
    grads = [p.grad.clone() for p in optimized(opt)]
    start = [p.detach().clone() for p in optimized(opt)]

    def one_step(**changes):
        copy_ = copy.deepcopy(opt)
        for group in copy_.param_groups:
            group.update(changes)
        params = optimized(copy_)
        same_grads(params, grads)
        copy_.step()
        return [p.detach() - s for p, s in zip(params, start, strict=True)]

    base = one_step()
    # tolerance: the parameters' float32 rounding (|X| ≲ 4), not the steps' size
    torch.testing.assert_close(one_step(lr=2 * LR), [2 * d for d in base], rtol=1e-4,
                               atol=1e-6)
    decayed = one_step(weight_decay=0.5)
    torch.testing.assert_close(decayed, [d - LR * 0.5 * s for d, s in zip(base, start,
                                                                          strict=True)],
                               rtol=1e-4, atol=1e-6)
    assert all(torch.equal(d, torch.zeros_like(d)) for d in one_step(lr=0.0, weight_decay=0.5))


@parametrize
def test_add_param_group(case):
    weight, bias = weight_bias()
    extra = nn.Parameter(torch.randn(4, 6))
    opt = case.make([weight, bias])
    groups = len(opt.param_groups)
    for group in route([{"params": [extra], "lr": 0.5 * LR}], case.path):
        opt.add_param_group(group)
    assert len(opt.param_groups) == groups + 1
    assert opt.param_groups[-1]["lr"] == 0.5 * LR
    before = extra.detach().clone()
    for p in optimized(opt):
        p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(extra, before)
    assert opt.state[extra]


@parametrize_ours
def test_a_rejected_param_group_is_not_added(case):
    weight, bias = weight_bias()
    extra = nn.Parameter(torch.randn(4, 6))
    opt = case.make([weight, bias])
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group(route([{"params": [extra], "lr": -1.0}], case.path)[0])
    assert len(opt.param_groups) == groups and extra not in opt.state


# ---------------------------------------------------------------------------- steps


@parametrize
def test_step_is_a_noop_for_params_without_grad(case):
    weight, bias = weight_bias()
    other = nn.Parameter(torch.randn(3, 4))
    opt = case.make([weight, bias, other], weight_decay=0.1)
    before = [p.detach().clone() for p in (other, bias)]
    state_before = copy.deepcopy({k: v for k, v in opt.state[other].items()})
    weight.grad = torch.randn_like(weight)
    assert opt.step(lambda: torch.tensor(1.0)) == torch.tensor(1.0)
    assert_same([other, bias], before)
    assert set(opt.state[other]) == set(state_before)
    for key, value in state_before.items():
        assert torch.equal(torch.as_tensor(opt.state[other][key]), torch.as_tensor(value))


@parametrize
def test_step_is_a_noop_for_zero_grads(case):
    param = nn.Parameter(torch.randn(5, 3))
    before = param.detach().clone()
    opt = case.make([param], weight_decay=0.0)
    param.grad = torch.zeros_like(param)
    opt.step()
    assert torch.equal(param, before)


@parametrize
def test_grads_are_never_modified_in_place(case):
    weight, bias = weight_bias()
    conv = nn.Parameter(torch.randn(4, 3, 3, 3)) if case.path != "matrix_only" else None
    params = [weight, bias] + ([conv] if conv is not None else [])
    opt = case.make(params)
    for _ in range(3):
        grads = []
        for p in optimized(opt):
            p.grad = torch.randn_like(p)
            grads.append(p.grad.clone())
        opt.step()
        assert_same([p.grad for p in optimized(opt)], grads)


@parametrize
def test_strided_params_and_grads_match_contiguous_ones(case):
    dense = [nn.Parameter(torch.randn(10, 5)), nn.Parameter(torch.randn(10))]
    strided = [nn.Parameter(torch.empty(10, 5, 2)[..., 0]),
               nn.Parameter(torch.empty(10, 2)[..., 0])]
    with torch.no_grad():
        for s, d in zip(strided, dense, strict=True):
            s.copy_(d)
    assert not strided[0].is_contiguous()
    opt_dense, opt_strided = case.make(dense), case.make(strided)
    for _ in range(3):
        for s, d in zip(strided, dense, strict=True):
            d.grad = torch.randn_like(d)
            s.grad = torch.empty(*d.shape, 3)[..., 1].copy_(d.grad)
        opt_dense.step()
        opt_strided.step()
    assert_same(strided, dense)


@parametrize
def test_closure_runs_with_grad_enabled_and_its_loss_is_returned(case):
    weight, bias = weight_bias()
    x = torch.randn(5)
    opt = case.make([weight, bias])
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        return closure_for(opt, weight, bias, x)()

    with torch.no_grad():
        loss = opt.step(closure)
    assert seen == [True] and loss.requires_grad
    assert opt.step() is None


@parametrize
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(case, set_to_none):
    weight, bias = weight_bias()
    opt = case.make([weight, bias])
    for p in optimized(opt):
        p.grad = torch.randn_like(p)
    opt.zero_grad(set_to_none=set_to_none)
    for p in optimized(opt):
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


@parametrize
def test_state_is_not_empty_after_a_step(case):
    model = nn.Linear(5, 5)
    opt = case.make(model.parameters())
    model(torch.rand(2, 5)).sum().backward()
    opt.step()
    assert all(opt.state[p] for p in optimized(opt))


@parametrize
def test_missing_state_is_created_on_the_step(case):
    """``opt.state`` reset (or a state dict without buffers loaded): the next step starts
    the missing state from zero, exactly as a new optimizer over the same values."""
    weight, bias = weight_bias()
    opt = case.make([weight, bias])
    for _ in range(2):
        for p in optimized(opt):
            p.grad = torch.randn_like(p)
        opt.step()
    fresh_params = clones(optimized(opt))
    fresh = case.factory([dict(g, params=fp) for g, fp in
                          zip(opt.param_groups, _split(fresh_params, opt), strict=True)])
    opt.state = defaultdict(dict)
    grads = [torch.randn_like(p) for p in optimized(opt)]
    same_grads(optimized(opt), grads)
    same_grads(fresh_params, grads)
    opt.step()
    fresh.step()
    assert_same(optimized(opt), fresh_params)

    emptied = opt.state_dict()
    emptied["state"] = {}
    opt.load_state_dict(emptied)
    same_grads(optimized(opt), grads)
    opt.step()
    assert all(opt.state[p] for p in optimized(opt))


def _split(params, opt):
    out, i = [], 0
    for group in opt.param_groups:
        out.append(params[i : i + len(group["params"])])
        i += len(group["params"])
    return out


@parametrize
def test_optimizer_can_be_printed(case):
    opt = case.make(weight_bias())
    assert type(opt).__name__ in repr(opt)


# ---------------------------------------------------------------------------- copies


def _primed(case, steps: int = 3):
    weight, bias = weight_bias()
    conv = [nn.Parameter(torch.randn(4, 3, 3, 3))] if case.path != "matrix_only" else []
    opt = case.make([weight, bias, *conv])
    for _ in range(steps):
        for p in optimized(opt):
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def _step_both(a, b, steps: int = 3):
    for _ in range(steps):
        for pa, pb in zip(optimized(a), optimized(b), strict=True):
            pa.grad = torch.randn_like(pa)
            pb.grad = pa.grad.clone()
        a.step()
        b.step()
    assert_same(optimized(b), optimized(a))


@parametrize
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_step_identically(case, how):
    opt = _primed(case)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        twin = pickle.loads(pickle.dumps(opt))
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert {k for k in vars(twin) if not k.startswith("_")} == public
    _step_both(opt, twin)


# ---------------------------------------------------------------------------- state dicts


def _named(params, named: bool):
    return [(f"p{i}", p) for i, p in enumerate(params)] if named else list(params)


def _without_names(state_dict):
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


@parametrize
@pytest.mark.parametrize("named", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "named-to-plain", "plain-to-named", "named"])
def test_state_dict_round_trip_into_a_fresh_optimizer(case, named):
    weight, bias = weight_bias()
    conv = [nn.Parameter(torch.randn(4, 3, 3, 3))] if case.path != "matrix_only" else []
    params = [weight, bias, *conv]
    opt = case.make(_named(params, named[0]))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    copies = clones(params)
    fresh = case.make(_named(copies, named[1]))
    saved, to_load = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.state_dict())
    fresh.load_state_dict(to_load)
    assert_equal_nested(to_load, saved)  # loading leaves the given state dict as it was
    _step_both(opt, fresh)
    assert_equal_nested(_without_names(fresh.state_dict()), _without_names(opt.state_dict()))
    if any(named):
        names = [n for g in fresh.state_dict()["param_groups"] for n in g["param_names"]]
        assert names == [n for g in route(_named(params, True), case.path)
                         for n, _ in g["params"]]
    fresh.param_groups.extend(fresh.param_groups)  # repeated groups: same representation
    assert (_without_names(fresh.state_dict())["param_groups"][-1]
            == _without_names(opt.state_dict())["param_groups"][-1])


@parametrize_ours
def test_a_named_state_dict_goes_to_the_parameters_of_its_names_in_any_order(case):
    """Two same-shape matrices with different momenta, loaded into an optimizer that lists them
    in the other order: each state follows its name (by position, as torch matches, they would
    swap silently); names that differ are refused."""
    first, second = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
    opt = case.make([("first", first), ("second", second)])
    for scale in (1.0, -3.0):
        first.grad, second.grad = torch.randn(6, 4), scale * torch.randn(6, 4)
        opt.step()
    twins = {"first": nn.Parameter(first.detach().clone()),
             "second": nn.Parameter(second.detach().clone())}
    swapped = case.make([("second", twins["second"]), ("first", twins["first"])])
    swapped.load_state_dict(copy.deepcopy(opt.state_dict()))
    for name, p in (("first", first), ("second", second)):
        assert_equal_nested(swapped.state[twins[name]], opt.state[p], name)
    for name, p in (("first", first), ("second", second)):
        p.grad = torch.randn(6, 4)
        twins[name].grad = p.grad.clone()
    opt.step()
    swapped.step()
    assert_same([twins["first"], twins["second"]], [first, second])
    other = case.make([("first", nn.Parameter(torch.randn(6, 4))),
                       ("third", nn.Parameter(torch.randn(6, 4)))])
    with pytest.raises(ValueError, match="^load_state_dict: param group 0 .* 'third'"):
        other.load_state_dict(copy.deepcopy(opt.state_dict()))


@parametrize
def test_state_dict_survives_a_weights_only_save_and_load(case):
    opt = _primed(case)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_equal_nested(loaded, opt.state_dict())


@parametrize
def test_older_state_dict_with_float_step_loads_and_steps_the_same(case):
    opt = _primed(case)
    twin = copy.deepcopy(opt)
    old = copy.deepcopy(opt.state_dict())
    converted = 0
    for state in old["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].item()
            converted += 1
    twin.load_state_dict(old)
    _step_both(opt, twin)
    for p in optimized(twin):
        if "step" in twin.state[p]:
            assert torch.is_tensor(twin.state[p]["step"])


@parametrize_ours
def test_state_dict_without_keys_added_later_loads(case):
    """Keys that a later version added (``HybridOrthogonalOptimizer.added_keys``) get their
    defaults when an older state dict lacks them."""
    opt = _primed(case)
    old = copy.deepcopy(opt.state_dict())
    added = getattr(type(opt), "added_keys", {})
    for group in old["param_groups"]:
        for key in added:
            group.pop(key, None)
    opt.load_state_dict(old)
    for group in opt.param_groups:
        for key, value in added.items():
            assert group[key] == value
    for p in optimized(opt):
        p.grad = torch.randn_like(p)
    opt.step()


# ---------------------------------------------------------------------------- hooks


@parametrize
def test_step_hooks_run_in_order_and_can_be_removed(case):
    calls = []
    opt = case.make([nn.Parameter(torch.randn(2, 3))])
    other = torch.optim.SGD([nn.Parameter(torch.randn(2, 3))])
    handles = [
        register_optimizer_step_pre_hook(lambda *a: calls.append("global-pre")),
        register_optimizer_step_post_hook(lambda *a: calls.append("global-post")),
        opt.register_step_pre_hook(lambda *a: calls.append("pre")),
        opt.register_step_post_hook(lambda *a: calls.append("post")),
    ]
    try:
        opt.step()
        other.step()
        assert calls == ["global-pre", "pre", "post", "global-post", "global-pre",
                         "global-post"]
    finally:
        for handle in handles:
            handle.remove()
    opt.step()
    assert len(calls) == 6


@parametrize
def test_state_dict_and_load_state_dict_hooks(case):
    opt = case.make([nn.Parameter(torch.randn(2, 3))])

    def pre(optimizer):
        optimizer.state["marker"] = 1

    def post(optimizer, state_dict):
        state_dict["ran_pre"] = state_dict["state"].pop("marker", None) == 1
        return state_dict

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    state_dict = opt.state_dict()
    assert state_dict["ran_pre"] and "marker" not in state_dict["state"]
    del opt.state["marker"]

    def load_pre(optimizer, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.003
        return sd

    loaded = []
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o.param_groups[0]["lr"]))
    opt.load_state_dict(state_dict)
    assert loaded == [0.003]


# ---------------------------------------------------------------------------- our group keys


@parametrize_ours
def test_a_misspelled_group_key_warns_with_did_you_mean(case):
    weight, bias = weight_bias()
    key = "momentun" if case in HYBRID_CASES else "gama"
    with pytest.warns(UserWarning, match=r"did you mean '(momentum|gamma)'"):
        case.make([{"params": [weight, bias], key: 0.5}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = case.make([{"params": [weight, bias], "name": "decoder"}])
    assert all(g["name"] == "decoder" for g in opt.param_groups)


@parametrize_hybrid
def test_hyper_parameters_are_stored_one_way_in_every_group(case):
    weight, bias = weight_bias()
    opt = case.make([weight, bias])
    assert {g["ns_dtype"] for g in opt.param_groups} == {"auto"}
    opt = case.make([weight, bias], ns_dtype=torch.float32)
    assert {g["ns_dtype"] for g in opt.param_groups} == {"float32"}
    opt = case.make([weight, bias], ns_dtype="AUTO")
    assert {g["ns_dtype"] for g in opt.param_groups} == {"auto"}


def test_mode_none_is_an_error_not_plain_muon():
    with pytest.raises(ValueError, match="mode"):
        build_optimizer("muoneq", [nn.Parameter(torch.randn(3, 4))], mode=None)
