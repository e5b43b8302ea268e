"""The planned stacked step (``muoneq.optim.plan``, ``muoneq.functional.step_stacks``): a budget
of operations per step that does not grow with the number of matrices, nothing allocated after
the first step, and momentum banks behind an unchanged state dict."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from muoneq import MuonEq, build_optimizer, diag_pre
from muoneq.newton_schulz import ns_settings
from muoneq.optim import hybrid, plan
from muoneq.suite.benchmarks.bench_step import MATRIX_SETS
from tests.helpers.dispatch import cpu_allocations, dispatched

pytestmark = pytest.mark.usefixtures("one_thread")

#: aten operations dispatched by one stacked MuonEq-R step (Nesterov, float32 parameters and
#: Newton–Schulz) on the benchmark's matrix sets (``muoneq bench``'s, miniature; the count does
#: not depend on the size). Per stack of same-shape matrices: gather 1, Nesterov 1, DiagPre and
#: the normalization 10, Newton–Schulz 3 per step and 2 transposed views, the update 1; per
#: group the decay 1 and the momentum 1. Before the plan (a copy into a fresh stack per
#: matrix, the cast and the update per matrix): 353, 376 and 863; with the momentum per stack
#: (one engine per path): 125, 94 and 311.
BUDGETS = {"gpt2_small": 122, "llama2_130m": 92, "resnet18": 302}
#: The same for AdaMuon (the sign and its per-chunk update: second moment, bias correction on
#: the device, RMS alignment) and Mousse on a step that refreshes no eigenbasis (per chunk the
#: gradients stacked, the factors' update, whitening, the map back and the graft), every
#: result written into the plan's buffers. With temporaries allocated per step: 181, 136, 451
#: and 338, 254, 842.
METHOD_BUDGETS = {"adamuon": {"gpt2_small": 174, "llama2_130m": 131, "resnet18": 432},
                  "mousse": {"gpt2_small": 222, "llama2_130m": 167, "resnet18": 552}}
MODES = ["none", "R", "C", "RC"]


def stepped(shapes, steps: int = 2, **options) -> MuonEq:
    """A stacked MuonEq over parameters of ``shapes`` with gradients, after ``steps`` steps
    (Newton–Schulz in float32, which ``"auto"`` is on CPUs without native bf16 products; whole
    shapes in one chunk, ``workspace_limit=None``)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = MuonEq(params, lr=0.02, **{"batching": "stacked", "ns_dtype": "float32",
                                     "workspace_limit": None, **options})
    for _ in range(steps):
        opt.step()
    return opt


def halved(shapes):
    return [(s[0] // 2, *s[1:]) if len(s) > 2 else (s[0] // 2, s[1] // 2) for s in shapes]


@pytest.mark.parametrize("name", BUDGETS)
def test_a_stacked_step_dispatches_its_budget_of_operations(name):
    seen = dispatched(stepped(MATRIX_SETS[name](True)).step)
    assert seen.total <= BUDGETS[name], seen.ops


@pytest.mark.parametrize("name", BUDGETS)
@pytest.mark.parametrize("mode", MODES)
def test_the_operations_grow_with_the_shapes_not_with_the_matrices(name, mode):
    shapes = MATRIX_SETS[name](True)
    counts = [dispatched(stepped(s, mode=mode).step).ops
              for s in (shapes, shapes * 3, halved(shapes))]
    assert counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_no_tensor_is_allocated_after_the_first_step(mode, nesterov, ns_dtype):
    shapes = MATRIX_SETS["gpt2_small"](True) + MATRIX_SETS["resnet18"](True)
    opt = stepped(shapes, steps=1, mode=mode, nesterov=nesterov, ns_dtype=ns_dtype)
    assert dispatched(opt.step).allocated == []
    opt.param_groups[0]["lr"] = 0.01  # a scheduler's change: nothing planned again
    opt.param_groups[0]["weight_decay"] = 0.0
    assert dispatched(opt.step).allocated == []


@pytest.mark.parametrize("mode", MODES)
def test_the_cpu_allocator_holds_no_buffer_after_the_first_step(mode):
    """The profiler's record of the CPU allocator, temporaries inside operations included: only
    the 8-byte wrappers the CPU makes of Python numbers passed to an operation."""
    opt = stepped(MATRIX_SETS["llama2_130m"](True), steps=1, mode=mode)
    assert max(cpu_allocations(opt.step)) <= 8


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_the_prologue_writes_diag_pre_divided_by_its_frobenius_norm(mode, eps, shape):
    """With the identity polynomial as Newton–Schulz, a step from zero reveals the normalized
    input ``DiagPre(M̃)/‖DiagPre(M̃)‖_F`` (R and C take the norm from their sums in closed form);
    a zero row and a zero column stay zero with ``ε = 0`` (Remark 3.3)."""
    G = torch.randn(shape, dtype=torch.float64) * torch.logspace(-2, 2, shape[1])
    G[1], G[:, 2] = 0, 0
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    p.grad = G.clone()
    opt = MuonEq([p], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0, mode=mode,
                 eps=eps, lr_adjust="none", ns_dtype="float64", ns_steps=1,
                 ns_coefficients=(1.0, 0.0, 0.0), batching="stacked")
    opt.step()
    balanced = diag_pre(G, mode, eps)
    torch.testing.assert_close(-p.detach(), balanced / balanced.norm(), rtol=1e-13, atol=0)


def test_momentum_is_one_bank_per_shape_behind_the_state_dict_of_the_per_matrix_path():
    shapes = [(8, 4), (8, 4), (4, 8), (8, 4)]
    stacked, per_matrix = (stepped(shapes, batching=b) for b in ("stacked", "per_matrix"))
    buffers = [stacked.state[p]["momentum_buffer"] for p in stacked.param_groups[0]["params"]]
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    assert len(storages) == 2  # one bank per stored shape, each parameter a row of it
    ours, theirs = stacked.state_dict(), per_matrix.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for i, state in theirs["state"].items():
        assert set(ours["state"][i]) == set(state)
        torch.testing.assert_close(ours["state"][i]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=1e-6, atol=1e-7)
    saved = io.BytesIO()
    torch.save(ours, saved)  # one bank per shape in the file, not one per parameter
    assert saved.tell() < 1.5 * sum(b.numel() * 4 for b in buffers) + 4096


def test_a_parameter_given_new_storage_is_planned_again():
    """``p.data = …`` (a model moved or cast in place) re-plans the group: the update lands in
    the parameter's new storage."""
    shapes = [(6, 4), (6, 4)]
    opt, reference = stepped(shapes), stepped(shapes)
    p = opt.param_groups[0]["params"][0]
    p.data = p.data.clone()
    opt.step()
    reference.step()
    for a, b in zip(opt.param_groups[0]["params"], reference.param_groups[0]["params"],
                    strict=True):
        assert torch.equal(a, b)


def identity_backend(X, coefficients):
    """A callable ``ns_backend`` that leaves the normalized input as it is."""
    return X


#: A change of each setting a group's plan depends on, made between steps (``ns_backend``: the
#: optimizer's option); the second value is what the reference optimizer is built with.
CHANGES = {
    "ns_steps": ("ns_steps", 3, 3),
    "ns_coefficients name": ("ns_coefficients", "polar_express", "polar_express"),
    "ns_coefficients list": ("ns_coefficients", [[3.0, -3.2, 1.2]] * 5, [[3.0, -3.2, 1.2]] * 5),
    "ns_dtype": ("ns_dtype", "float64", "float64"),
    "ns_algorithm": ("ns_algorithm", "gram", "gram"),
    "mode": ("mode", "C", "C"),
    "mode alias": ("mode", "row", "R"),
    "nesterov": ("nesterov", False, False),
    "lr_adjust": ("lr_adjust", "spectral", "spectral"),
    "ns_backend": ("ns_backend", identity_backend, identity_backend),
}
SHAPES = [(4, 32), (4, 32), (6, 6)]  # the Gram order is cheaper on 4×32


def assert_steps_as_built_with(opt: MuonEq, **settings) -> None:
    """``opt``'s next step equals that of an optimizer built with ``settings`` (and ``opt``'s
    other options) on copies of its parameters and momentum, bit for bit."""
    params = opt.param_groups[0]["params"]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, copies, strict=True):
        q.grad = p.grad.clone()
    group = {key: value for key, value in opt.param_groups[0].items() if key != "params"}
    reference = MuonEq([{**group, "params": copies}], batching=opt.batching,
                       ns_backend=settings.pop("ns_backend", opt.ns_backend),
                       workspace_limit=None, **settings)
    for p, q in zip(params, copies, strict=True):
        reference.state[q]["momentum_buffer"].copy_(opt.state[p]["momentum_buffer"])
    opt.step()
    reference.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("batching", ["stacked", "per_matrix"])
@pytest.mark.parametrize("change", CHANGES)
def test_a_setting_changed_between_steps_is_planned_again(change, batching):
    key, value, built = CHANGES[change]
    opt = stepped(SHAPES, batching=batching)
    if key == "ns_backend":
        opt.ns_backend = value
    else:
        opt.param_groups[0][key] = value
    assert_steps_as_built_with(opt, **{key: built})
    assert_steps_as_built_with(opt, **{key: built})  # and kept


@pytest.mark.parametrize("batching", ["stacked", "per_matrix"])
def test_coefficients_changed_in_place_in_a_list_are_planned_again(batching):
    """A list in the group can change without being replaced: its new values are stepped."""
    opt = stepped(SHAPES, batching=batching)
    coefficients = [[3.4445, -4.7750, 2.0315] for _ in range(5)]
    opt.param_groups[0]["ns_coefficients"] = coefficients
    assert_steps_as_built_with(opt, ns_coefficients=[tuple(c) for c in coefficients])
    coefficients[2][0] = 3.0
    assert_steps_as_built_with(opt, ns_coefficients=[tuple(c) for c in coefficients])
    coefficients.append([3.0, -3.2, 1.2])
    with pytest.raises(ValueError, match=r"^ns_coefficients: a per-step list must have exactly "
                                         r"ns_steps=5 tuples, got 6$"):
        opt.step()


#: Bad values of the settings a plan depends on, set between steps.
BAD = [("ns_steps", 0), ("ns_steps", 2.5), ("ns_steps", True), ("ns_coefficients", "foo"),
       ("ns_coefficients", [1, 2]), ("ns_dtype", "int8"), ("ns_dtype", torch.int8),
       ("ns_algorithm", "x"), ("mode", "X"), ("mode", None), ("nesterov", "yes"),
       ("lr_adjust", "bogus")]


@pytest.mark.parametrize(("key", "value"), BAD)
def test_a_bad_value_set_between_steps_is_the_constructors_one_line_error(key, value):
    with pytest.raises(ValueError) as built:
        MuonEq([nn.Parameter(torch.randn(4, 8))], **{key: value})
    opt = stepped(SHAPES)
    good = opt.param_groups[0][key]
    weights = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    opt.param_groups[0][key] = value
    for _ in range(2):  # refused every time, and nothing stepped
        with pytest.raises(ValueError) as stepping:
            opt.step()
        assert str(stepping.value) == str(built.value) and "\n" not in str(built.value)
    assert all(map(torch.equal, weights, opt.param_groups[0]["params"]))
    opt.param_groups[0][key] = good
    opt.step()


def test_the_settings_are_checked_again_only_when_one_changes(monkeypatch):
    """The step's host work: a group's Newton–Schulz settings are made again (and its values
    checked) only when one of them was replaced, or at every step while one is a list."""
    made = []
    monkeypatch.setattr(hybrid, "ns_settings",
                        lambda *args, **kwargs: made.append(args) or ns_settings(*args, **kwargs))
    opt = stepped(SHAPES + [(5, 3)], steps=1)
    opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 5))]})
    opt.param_groups[1]["params"][0].grad = torch.randn(3, 5)
    opt.step()
    made.clear()
    for _ in range(3):
        opt.param_groups[0]["lr"] *= 0.5  # a scheduler's change
        opt.step()
    assert made == []
    opt.param_groups[1]["ns_steps"] = 4
    opt.step()
    opt.step()
    assert [args[0] for args in made] == [4]
    opt.param_groups[0]["ns_coefficients"] = [[3.4445, -4.7750, 2.0315]] * 5
    opt.step()
    opt.step()
    assert len(made) == 3


def test_an_added_group_is_stepped_as_in_an_optimizer_built_with_it():
    gen = torch.Generator().manual_seed(1)
    first, second = ([nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(2)]
                     for _ in range(2))
    twins = [[nn.Parameter(p.detach().clone()) for p in ps] for ps in (first, second)]
    grads = [torch.randn(5, 3, generator=gen) for _ in range(4)]
    opt = MuonEq(first, lr=0.02, batching="stacked")
    for p, g in zip(first, grads, strict=False):
        p.grad = g
    opt.step()
    opt.add_param_group({"params": second, "mode": "RC"})
    built = MuonEq([{"params": twins[0]}, {"params": twins[1], "mode": "RC"}], lr=0.02,
                   batching="stacked")
    for p, g in zip(twins[0], grads, strict=False):
        p.grad = g
    built.step()
    for params in (first + second, twins[0] + twins[1]):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    opt.step()
    built.step()
    for a, b in zip(first + second, twins[0] + twins[1], strict=True):
        assert torch.equal(a, b)


def stacked_and_per_matrix(method: str, steps: int = 3, reset_after: int | None = None,
                           **options) -> dict:
    """Parameters, state dict and the last step's dispatch of ``method`` on both paths, in
    float64, after ``steps`` steps (the state of the first parameter reset after
    ``reset_after`` of them)."""
    shapes = [(12, 20)] * 3 + [(20, 12), (8, 3, 2, 2), (8, 12)]
    results = {}
    for batching in ("stacked", "per_matrix"):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
                  for s in shapes]
        opt = build_optimizer(method, [{"params": params}], lr=0.05, ns_dtype="float64",
                              batching=batching, workspace_limit=None, **options)
        for step in range(steps):
            if step == reset_after:
                opt.state[params[0]].clear()
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            seen = dispatched(opt.step)
        results[batching] = (params, opt.state_dict()["state"], seen)
    return results


def assert_same_result(results: dict) -> None:
    (stacked, ours, _), (per_matrix, theirs, _) = results["stacked"], results["per_matrix"]
    for a, b in zip(stacked, per_matrix, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for i, state in theirs.items():
        assert set(ours[i]) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(ours[i][key], value, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["normuon", "muon_plus"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_normuon_and_muon_plus_ride_the_stacked_path_with_the_per_matrix_result(method,
                                                                               nesterov):
    """Their rules (a row second moment, banked like the momentum; column/row normalizations)
    run batched after the stacked Newton–Schulz and give the per-matrix path's parameters and
    state, in float64."""
    results = stacked_and_per_matrix(method, nesterov=nesterov)
    assert results["stacked"][2].ops["bmm"] == 5 * 3  # NS5 for the 3 matrix shapes, stacked
    assert_same_result(results)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("sign_momentum", [True, False])
def test_adamuon_rides_the_stacked_path_with_the_per_matrix_result(nesterov, sign_momentum):
    """sign(M̃) before the stacked Newton–Schulz, the element-wise second moment and the step
    counts banked like the momentum: the per-matrix path's parameters and state, in float64."""
    results = stacked_and_per_matrix("adamuon", steps=4, nesterov=nesterov,
                                     sign_momentum=sign_momentum)
    assert results["stacked"][2].ops["bmm"] == 5 * 3
    assert_same_result(results)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("precond_every", [1, 2])
def test_mousse_rides_the_stacked_path_with_the_per_matrix_result(nesterov, precond_every):
    """Kronecker factors, eigendecompositions (one batched ``eigh`` per bank and side),
    whitening, Newton–Schulz, the map back and the graft on stacks: the per-matrix path's
    parameters and state, in float64; a state reset in the middle restarts that matrix's
    refresh schedule alone."""
    results = stacked_and_per_matrix("mousse", steps=5, reset_after=2, nesterov=nesterov,
                                     precond_every=precond_every)
    stacked = results["stacked"][2].ops
    # per chunk (3 shapes) NS5, per bank in it (4: the conv filter and the 8×12 matrix share
    # a chunk) the whitening and the map back, and one batched eigh of L and of R
    assert stacked["bmm"] == 5 * 3 + 4 * 4
    assert stacked["_linalg_eigh"] == 2 * 4
    assert_same_result(results)


@pytest.mark.parametrize("method", ["adamuon", "mousse"])
@pytest.mark.parametrize("name", BUDGETS)
def test_adamuon_and_mousse_steps_grow_with_the_shapes_not_with_the_matrices(method, name):
    shapes = MATRIX_SETS[name](True)
    counts = [dispatched(stepped_with(method, s).step).ops
              for s in (shapes, shapes * 3, halved(shapes))]
    assert counts[0] == counts[1] == counts[2]
    assert sum(counts[0].values()) <= METHOD_BUDGETS[method][name], counts[0]


def stepped_with(method: str, shapes, steps: int = 2):
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = build_optimizer(method, [{"params": params}], lr=0.02, batching="stacked",
                          ns_dtype="float32", workspace_limit=None)
    for _ in range(steps):
        opt.step()
    return opt


@pytest.mark.parametrize("method", ["muon_plus", "normuon", "adamuon", "mousse"])
@pytest.mark.parametrize("batching", ["stacked", "per_matrix"])
@pytest.mark.parametrize(("dtype", "ns_dtype"), [(torch.float32, "float32"),
                                                 (torch.float32, "bfloat16"),
                                                 (torch.bfloat16, "float32")])
def test_no_method_allocates_after_the_first_step(method, batching, dtype, ns_dtype):
    """A method's rule writes into the scratch it asked the plan for and into its banked
    state: after the first step nothing is allocated, on either path, with Newton–Schulz in
    another dtype than the accumulation's (its output cast into the chunk's stack) and with
    bf16 parameters (state rounded through buffers of theirs). Mousse refreshes its
    eigenbases at the third step (``precond_every=2``)."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype))
              for s in [(12, 8), (12, 8), (8, 20), (6, 2, 2, 2)]]
    options = {"precond_every": 2} if method == "mousse" else {}
    opt = build_optimizer(method, [{"params": params}], lr=0.02, batching=batching,
                          ns_dtype=ns_dtype, workspace_limit=None, **options)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        seen = dispatched(opt.step)
        assert step == 0 or seen.allocated == [], seen.allocated


@pytest.mark.parametrize("batching", ["stacked", "per_matrix"])
def test_an_adamuon_step_reads_nothing_back_from_the_device(batching):
    """Its bias correction ``1 − β₂ᵗ`` is computed from the step counts on the device."""
    opt = stepped_with("adamuon", [(6, 4), (6, 4), (4, 6)])
    opt.batching = batching
    assert "_local_scalar_dense" not in dispatched(opt.step).ops


@pytest.mark.parametrize("method", ["muoneq", "normuon", "muon_plus", "adamuon", "mousse"])
def test_the_stacks_are_planned_once(method, monkeypatch):
    """Later steps reuse the plan and its buffers (a method's ``finish`` is a new closure each
    step, and must not make the settings look changed)."""
    planned = []
    plan_stacks = plan.plan_stacks
    monkeypatch.setattr(plan, "plan_stacks",
                        lambda *a, **k: planned.append(1) or plan_stacks(*a, **k))
    stepped_with(method, [(6, 4), (6, 4), (4, 6)], steps=3)
    assert len(planned) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "nesterov"), [("R", True), ("none", False)])
def test_compile_compiles_each_chunks_stages_once_and_rounds_as_eager(mode, nesterov):
    """``compile=True`` on the stacked path: per chunk (shape) one graph for the prologue and
    one for the update, ``fullgraph``, compiled at the first step (a learning rate changed by
    a scheduler compiles nothing); the weights equal eager's within float32 rounding."""
    from torch._dynamo.utils import counters

    shapes = [(12, 20)] * 3 + [(20, 12)]
    results, graphs = [], 0
    for compile in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = MuonEq(params, lr=0.05, mode=mode, nesterov=nesterov, ns_dtype="float32",
                     batching="stacked", compile=compile, workspace_limit=None)
        before = counters["stats"]["unique_graphs"]
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.param_groups[0]["lr"] = 0.05 / (step + 1)
            opt.step()
        graphs = counters["stats"]["unique_graphs"] - before
        results.append(params)
    assert graphs == 2 * 2
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def gpt2_workspace_by_hand(per_chunk: int) -> int:
    """Bytes of the stacked path's buffers for the full-size GPT-2-small set, MuonEq-R, float32
    parameters, bf16 Newton–Schulz, ``per_chunk`` matrices a chunk: each named buffer is as
    large as its largest chunk's — M̃ (float32), the NS input and the iterate it alternates
    with (bf16), the Gram and polynomial stacks (bf16), the row sums, ``sums + ε`` and scales
    (float32), the norms (float32) and ``−a·η``."""
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
    k = per_chunk
    largest = {
        "stack": max(k * m * n * 4 for m, n in shapes),
        "ns_input": max(k * m * n * 2 for m, n in shapes),
        "ns_iterate": max(k * m * n * 2 for m, n in shapes),
        "ns_gram": max(k * min(m, n) ** 2 * 2 for m, n in shapes),
        "ns_poly": max(k * min(m, n) ** 2 * 2 for m, n in shapes),
        "row vectors": 3 * max(k * m * 4 for m, n in shapes),
        "norm": k * 4,
        "step": 4,
    }
    return sum(largest.values())


@pytest.mark.parametrize("limit_mib", [None, 64, 44, 16, 0])
def test_workspace_limit_bounds_the_workspace_the_plan_holds(limit_mib):
    """Planned on the meta device (nothing allocated) for the full-size GPT-2-small set: without a
    limit, 12 matrices a chunk and 243 MiB of buffers; a limit stacks fewer matrices per call
    until the workspace fits, never fewer than one (its floor: 20 MiB)."""
    shapes = MATRIX_SETS["gpt2_small"](False)
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    limit = None if limit_mib is None else limit_mib << 20
    opt = MuonEq(params, batching="stacked", ns_dtype="bfloat16", workspace_limit=limit)
    planned = opt.workspace_bytes
    chunks = [c for step in opt._planned().values() for c in step.chunks]
    if limit is None:
        assert planned == gpt2_workspace_by_hand(12) and len(chunks) == 4
        assert round(planned / 2**20) == 243
    elif limit >= gpt2_workspace_by_hand(1):
        assert planned <= limit and len(chunks) > 4
    else:  # below the floor: one matrix per chunk
        assert planned == gpt2_workspace_by_hand(1) and len(chunks) == 48
        assert round(planned / 2**20) == 20


@pytest.mark.parametrize("mode", MODES)
def test_a_workspace_limit_changes_the_chunks_not_the_result(mode):
    """Chunks of one or two matrices under a limit: the weights of the unbounded stacked step,
    in float64 (each matrix's arithmetic is the same in any stack)."""
    shapes = [(12, 20)] * 5 + [(20, 12), (8, 3, 2, 2)]
    results = []
    for limit in (None, 2 * 12 * 20 * 8 * 4):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
                  for s in shapes]
        opt = MuonEq(params, lr=0.05, mode=mode, ns_dtype="float64", batching="stacked",
                     workspace_limit=limit)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
        chunks = [c for step in opt._planned().values() for c in step.chunks]
        results.append((params, len(chunks), opt.workspace_bytes))
    (unbounded, few, big), (bounded, many, small) = results
    assert many > few and small < big
    for a, b in zip(bounded, unbounded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("limit", [-1, 1.5, True, "64MB"])
def test_a_bad_workspace_limit_is_one_line_naming_it(limit):
    with pytest.raises(ValueError,
                       match="^workspace_limit: expected 'auto', None or a number of bytes"):
        MuonEq([nn.Parameter(torch.randn(3, 3))], workspace_limit=limit)


def torch_muon_peak(shapes) -> int:
    """``torch.optim.Muon``'s peak extra memory on a set: that of its largest matrix (it steps
    one at a time), measured on this CPU (the profiler's allocation trace) with one
    Newton–Schulz step (K steps hold the same temporaries)."""
    from muoneq.suite.benchmarks.bench_step import peak_extra_bytes

    largest = max(shapes, key=lambda s: s[0] * s[1])
    p = nn.Parameter(torch.zeros(largest))
    p.grad = torch.randn(largest)
    opt = torch.optim.Muon([p], ns_steps=1, adjust_lr_fn="match_rms_adamw")
    opt.step()
    return peak_extra_bytes(opt.step, torch.device("cpu"))


#: The default workspace of the full-size sets (``workspace_limit="auto"``), MuonEq-R, bf16
#: Newton–Schulz, planned on the meta device: MiB, chunks, and the aten operations of a step.
DEFAULT_PLANS = {"gpt2_small": (38.3, 33, 1025), "llama2_130m": (27.0, 48, 1490)}


@pytest.mark.parametrize("name", DEFAULT_PLANS)
def test_the_default_workspace_is_within_twice_torch_muons_extra_memory(name):
    """The default bound keeps a step's extra memory (the workspace: a stacked step allocates
    nothing else) within twice what torch.optim.Muon's step takes; what that costs in
    operations against whole-shape chunks is stated here."""
    shapes = MATRIX_SETS[name](False)
    params = [nn.Parameter(torch.zeros(s, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.zeros(p.shape, device="meta")
    opt = MuonEq(params, batching="stacked", ns_dtype="bfloat16")
    opt.step()
    planned, steps = opt.workspace_bytes, opt._planned().values()
    assert planned <= 2 * torch_muon_peak(shapes)
    mib, chunks, ops = DEFAULT_PLANS[name]
    assert round(planned / 2**20, 1) == mib
    assert sum(len(step.chunks) for step in steps) == chunks
    assert dispatched(opt.step).total == ops


def test_the_gram_order_is_chosen_per_chunk_and_its_buffers_kept_within_the_limit():
    """``ns_algorithm="gram"``: the chunks of 1:4 matrices take the Gram order (the FLOP rule),
    the square ones the standard order; the Gram buffers are the plan's, counted in
    ``workspace_bytes`` and bounded by ``workspace_limit`` as every other buffer; the bounded
    plan steps as the unbounded one."""
    from muoneq.newton_schulz import GramIteration, StackIteration

    shapes = [(16, 64)] * 6 + [(16, 16)] * 2
    results = []
    for limit in (None, 60_000):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
                  for s in shapes]
        opt = MuonEq(params, lr=0.05, ns_dtype="float64", ns_algorithm="gram",
                     batching="stacked", workspace_limit=limit)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
        chunks = [c for step in opt._planned().values() for c in step.chunks]
        assert {c.shape: type(c.iteration) for c in chunks} == {(16, 64): GramIteration,
                                                                (16, 16): StackIteration}
        gram = sum(opt._workspace._flat[key].numel() * 8 for key in opt._workspace._flat
                   if key[0].startswith("gram_"))
        results.append((params, len(chunks), opt.workspace_bytes, gram))
    (unbounded, few, big, gram), (bounded, many, small, _) = results
    assert gram > 0 and big >= gram
    assert small <= 60_000 < big and many > few
    for a, b in zip(bounded, unbounded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
