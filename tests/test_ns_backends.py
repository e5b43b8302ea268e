"""Newton–Schulz backends (``ns_backend``): this project's Triton kernels, run on CPU by Triton's
interpreter, against torch's batched products; a callable; ``"auto"``'s choice; bad values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muoneq import MuonEq, newton_schulz
from muoneq.newton_schulz import QUINTIC, StackIteration, fastest_iteration
from muoneq.optim import NorMuon
from tests.helpers.reference import polar_ref

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16]
#: wide, tall, square, sizes that are not multiples of the kernels' 64-wide tiles
SHAPES = [(2, 40, 70), (2, 70, 40), (1, 65, 65), (3, 16, 130)]


def iterate_stack(X, coefficients, *, other, gram, poly):
    """``ns_backend="torch"``'s stacked iteration in the given buffers."""
    return StackIteration().iterate(X, coefficients,
                                    {"ns_other": other, "ns_gram": gram, "ns_poly": poly})


def normalized(shape, dtype, seed=0):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (X / X.norm(dim=(-2, -1), keepdim=True)).to(dtype)


def assert_within_rounding(got, want, dtype):
    """Elementwise within one unit of ``dtype``'s rounding of the largest entry (float32: of
    its sums of products, which the two add up in different orders)."""
    units = 16 if dtype == torch.float32 else 1
    ulp = units * torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), rtol=torch.finfo(dtype).eps,
                               atol=ulp)


def wide(X):
    return X.mT if X.size(-2) > X.size(-1) else X


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_symmetric_gram_is_torchs_product(kernels, shape, dtype):
    Y = wide(normalized(shape, dtype))  # a tall stack is read through its transposed strides
    got = kernels.symmetric_gram(Y, torch.full((Y.shape[0], Y.shape[1], Y.shape[1]), torch.nan,
                                               dtype=dtype))
    assert torch.equal(got, got.mT)  # both triangles written
    assert_within_rounding(got, torch.bmm(Y, Y.mT), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_polynomial_and_its_application_are_torchs_baddbmm(kernels, shape, dtype):
    a, b, c = QUINTIC
    Y = wide(normalized(shape, dtype))
    A = torch.bmm(Y, Y.mT)
    B = kernels.symmetric_polynomial(A, b, c, torch.empty_like(A))
    assert_within_rounding(B, torch.baddbmm(A, A, A, beta=b, alpha=c), dtype)
    out = kernels.apply_polynomial(Y, B, a, torch.empty_like(Y))
    assert_within_rounding(out, torch.baddbmm(Y, B, Y, beta=a), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("spectrum", ["gaussian", "decaying"])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_triton_ns5_meets_the_accuracy_rule_against_torchs(kernels, shape, spectrum):
    """bf16 NS5 in the kernels is within 1.5× torch's bf16 error to float64 NS5; in float32 the
    two agree to float32 rounding. Tall stacks are iterated tall (``XᵀX``)."""
    X = normalized(shape, torch.float64)
    if spectrum == "decaying":
        U, _, V = torch.linalg.svd(X, full_matrices=False)
        X = U @ torch.diag_embed(torch.logspace(0, -3, U.shape[-1], dtype=X.dtype)) @ V
        X = X / X.norm(dim=(-2, -1), keepdim=True)
    exact = run(iterate_stack, X)
    errors = {}
    for name, iterate in (("torch", iterate_stack), ("triton", kernels.iterate_stack)):
        found = run(iterate, X.bfloat16())
        errors[name] = ((found - exact).norm() / exact.norm()).item()
        if name == "triton":
            torch.testing.assert_close(run(iterate, X.float()), run(iterate_stack, X.float()),
                                       rtol=1e-4, atol=1e-5)
    assert errors["triton"] <= 1.5 * errors["torch"], errors


def run(iterate, X):
    small = min(X.shape[-2:])
    X = X.clone()
    gram = torch.empty(X.shape[0], small, small, dtype=X.dtype)
    out = iterate(X, (QUINTIC,) * 5, other=torch.empty_like(X), gram=gram,
                  poly=torch.empty_like(gram))
    assert out.data_ptr() in (X.data_ptr(), out.data_ptr())  # one of the two buffers
    return out.double()


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["stacked", "per_matrix"])
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_muoneq_on_the_triton_backend_steps_as_on_torchs(kernels, batching, ns_dtype):
    shapes = [(24, 40), (40, 24), (24, 40), (8, 3, 2, 2)]
    results = {}
    for backend in ("torch", "triton"):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = MuonEq(params, lr=0.02, mode="RC", ns_dtype=ns_dtype, batching=batching,
                     ns_backend=backend)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        results[backend] = params
        if batching == "stacked":
            assert set(opt.planned_backends.values()) == {backend}
    # two steps of 0.02·0.2·√40 each; the directions agree to the NS dtype's rounding
    tolerance = 2 * 0.02 * 0.2 * 40**0.5 * (2e-2 if ns_dtype == "bfloat16" else 1e-5)
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert (a - b).abs().max() < tolerance


def test_every_method_orthogonalizes_through_the_backend(kernels):
    calls = []

    def recording(X, coefficients):
        calls.append(tuple(X.shape))
        return iterate_stack(X, coefficients, other=torch.empty_like(X),
                             gram=torch.empty(X.shape[0], *[min(X.shape[-2:])] * 2),
                             poly=torch.empty(X.shape[0], *[min(X.shape[-2:])] * 2))

    p = nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4)
    NorMuon([p], ns_backend=recording, ns_dtype="float32").step()
    assert calls == [(1, 6, 4)]  # one matrix, as a stack of one, as stored


def test_a_callable_backend_gives_the_torch_result_and_its_shape_is_checked():
    shapes = [(12, 20), (12, 20), (20, 12)]

    def steps(backend):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = MuonEq(params, lr=0.02, batching="stacked", ns_backend=backend)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        return params

    def mine(X, coefficients):
        return run(iterate_stack, X).to(X.dtype)

    for a, b in zip(steps("torch"), steps(mine), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"^ns_backend: the callable returned \(1, 20\)"):
        steps(lambda X, coefficients: X[0, 0:1])


def test_auto_is_torch_on_a_cpu_and_picks_only_a_faster_backend_that_agrees():
    p = nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    opt = MuonEq([p], batching="stacked", ns_backend="auto")
    opt.step()
    assert opt.planned_backends == {(8, 16): "torch"}

    X = torch.empty(2, 8, 16)
    buffers = {"ns_other": torch.empty_like(X), "ns_gram": torch.empty(2, 8, 8),
               "ns_poly": torch.empty(2, 8, 8)}

    class Copy(StackIteration):
        name = "copy"

    class Wrong(StackIteration):
        name = "wrong"

        def iterate(self, X, coefficients, buffers):
            return X.zero_()

    candidates = {"torch": StackIteration(), "copy": Copy(), "wrong": Wrong()}
    speed = {"torch": 2.0, "copy": 1.0, "wrong": 0.1}
    timing = []

    def fake_time(run):  # which candidate ``run`` calls: the last one checked for agreement
        run()
        return speed[timing[-1]]

    def choose(*names):
        timing.clear()
        chosen = {n: candidates[n] for n in names}
        for name, iteration in chosen.items():
            iteration.iterate = _noting(iteration.iterate, name, timing)
        try:
            return fastest_iteration(chosen, X, (QUINTIC,) * 5, buffers, time_of=fake_time)
        finally:
            for iteration in chosen.values():
                del iteration.iterate

    assert choose("torch", "wrong") == "torch"  # faster but wrong
    assert choose("torch", "copy", "wrong") == "copy"
    speed["copy"] = 2.0
    assert choose("torch", "copy") == "torch"  # a tie: torch


def _noting(iterate, name, timing):
    def noted(*args):
        timing.append(name)
        return iterate(*args)
    return noted


@pytest.mark.parametrize("value", ["cuda", "", None, 3])
def test_a_bad_backend_is_a_one_line_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^ns_backend: unknown value .*; allowed: torch, "
                                         r"triton, auto, or a callable"):
        MuonEq([nn.Parameter(torch.randn(3, 3))], ns_backend=value)


def test_triton_refuses_a_cpu_without_its_interpreter_and_float64(kernels, monkeypatch):
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"^ns_backend='triton': .*float64 is not supported"):
        MuonEq([p], ns_backend="triton", ns_dtype="float64")
    monkeypatch.setattr(kernels, "_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match=r"^ns_backend='triton': the kernels run on CUDA "
                                           r"tensors, got cpu"):
        MuonEq([p], ns_backend="triton")


def test_the_polar_express_schedule_meets_the_accuracy_rule_in_bfloat16():
    """Opt-in ``ns_coefficients="polar_express"`` (Amsel et al.'s published per-step tuples,
    input scaled by 1.02·‖G‖_F): in bf16, on a Gaussian input and on one whose spectrum decays
    to 1e-3, its distance to the polar factor is at most the quintic schedule's."""
    gen = torch.Generator().manual_seed(2)
    for decaying in (False, True):
        G = torch.randn(96, 256, generator=gen, dtype=torch.float64)
        if decaying:
            U, _, V = torch.linalg.svd(G, full_matrices=False)
            G = U @ torch.diag(torch.logspace(0, -3, 96, dtype=G.dtype)) @ V
        exact = torch.from_numpy(polar_ref(G.numpy()))
        errors = {name: ((newton_schulz(G, 5, name, torch.bfloat16).double() - exact).norm()
                         / exact.norm()).item() for name in ("quintic", "polar_express")}
        assert errors["polar_express"] <= errors["quintic"], errors


def test_a_launch_records_its_configuration_and_offsets_the_stack_in_64_bits(kernels):
    """The configuration a device ran is recorded (the interpreter: the default one), and a
    matrix's offset in the stack is a 64-bit product (a stack can exceed 2³¹ elements)."""
    import inspect

    Y = normalized((2, 16, 24), torch.float32)
    kernels.symmetric_gram(Y, torch.empty(2, 16, 16))
    assert kernels.CHOSEN["cpu"] is kernels.DEFAULT_CONFIG
    for kernel in (kernels._symmetric_kernel, kernels._apply_kernel):
        assert "tl.program_id(2).to(tl.int64)" in inspect.getsource(kernel.fn)


def test_a_backend_that_cannot_run_the_gram_order_is_one_line():
    """Wherever the two meet — the constructor, a group changed later, ``newton_schulz`` —
    never the Gram order silently in place of the backend asked for."""
    def mine(X, coefficients):
        return X

    message = r"^ns_algorithm: 'gram' runs on torch's products; ns_backend={} runs the standard"
    with pytest.raises(ValueError, match=message.format("mine")):
        MuonEq([nn.Parameter(torch.randn(4, 8))], ns_algorithm="gram", ns_backend=mine)
    with pytest.raises(ValueError, match=message.format("'triton'")):
        MuonEq([nn.Parameter(torch.randn(4, 8))], ns_algorithm="gram", ns_backend="triton")
    p = nn.Parameter(torch.randn(4, 16))
    p.grad = torch.randn(4, 16)
    opt = MuonEq([p], ns_backend=mine)
    opt.param_groups[0]["ns_algorithm"] = "gram"
    with pytest.raises(ValueError, match=message.format("mine")):
        opt.step()
    with pytest.raises(ValueError, match=message.format("mine")):
        newton_schulz(torch.randn(4, 16), algorithm="gram", backend=mine)
