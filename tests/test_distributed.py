"""DDP, FSDP2 (fully_shard and Lightning's ModelParallelStrategy) and DCP, against one process.

Every multi-process check spawns 2 gloo processes on CPU. Each rank sees the *same* batch,
so the all-reduced gradients equal the single-process ones exactly and any difference comes
from the optimizer's distributed path (the issue's bound for fp32 NS: 1e-6 relative).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from muoneq import MuonEq, build_optimizer
from muoneq.newton_schulz import ns_flops
from muoneq.optim import AdaMuon, Mousse, MuonPlus, NorMuon
from muoneq.optim.distributed import balance, shard_rows
from tests.helpers.layout import CASES, block_grads, initial_blocks, run_separate
from tests.helpers.ports import free_port

WORLD = 2
STEPS = 3
#: The methods other than MuonEq, split like it (those with state of their own update the
#: state of the matrices they own, which travels with the matrices' rows).
METHODS = {"normuon": NorMuon, "adamuon": AdaMuon, "mousse": Mousse, "muon_plus": MuonPlus}
#: their own keywords in these runs: Mousse refreshes its eigenbases at steps 1 and 3
METHOD_OPTIONS = {"mousse": {"precond_every": 2}}
TOLERANCE = 1e-6
#: on the path of the Lightning script's process, which imports this module as ``tests.…``
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers
def make_model() -> nn.Module:
    """Uneven row counts (9, 5, 3, 1 rows over 2 ranks) and a conv filter (8, 3, 3, 3)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 9), nn.Tanh(),
        nn.Linear(9, 5, bias=False), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 3, 4, 4, generator=g), torch.randn(6, 1, generator=g)


def groups(model: nn.Module, **hparams) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "use_muon": True, **hparams},
        {"params": [p for p in params if p.ndim < 2], "use_muon": False},
    ]


def train(model, opt, steps: int, first: int = 0) -> None:
    for t in range(first, first + steps):
        x, y = batch(t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def build(kind: str, model: nn.Module, cls: type | None = None, **options):
    """``kind``: a DiagPre mode of MuonEq or a name of :data:`METHODS`, ``/stacked`` for the
    stacked path (Newton–Schulz in float32); ``cls``: a subclass of its class to build."""
    hparams = {"lr": 0.05, "weight_decay": 0.1}
    name, _, batching = kind.partition("/")
    if name in METHODS:
        return (cls or METHODS[name])(groups(model), ns_dtype=torch.float32,
                                      batching=batching or "auto", **hparams,
                                      **METHOD_OPTIONS.get(name, {}), **options)
    return (cls or MuonEq)(groups(model), mode=name, ns_dtype=torch.float32,
                           batching=batching or "auto", **hparams, **options)


def single_process(kind: str, steps: int = STEPS, with_state: bool = False):
    """The reference run, on one thread like the workers (BLAS rounds by thread count): the
    parameters, and with ``with_state`` the optimizer's state by parameter index."""
    with one_thread():
        model = make_model()
        opt = build(kind, model)
        train(model, opt, steps)
        params = [p.detach().clone() for p in model.parameters()]
        return (params, matrix_state(model, opt)) if with_state else params


@contextlib.contextmanager
def one_thread():
    """torch on one thread, as the workers run (BLAS rounds by thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def matrix_state(model: nn.Module, opt) -> list[dict[str, torch.Tensor]]:
    """The state of each matrix parameter, whole (a sharded state's ``full_tensor()``)."""
    from muoneq.optim.plan import is_dtensor

    return [{key: (t.full_tensor() if is_dtensor(t) else t).detach().clone()
             for key, t in opt.state[p].items()} for p in model.parameters() if p.ndim >= 2]


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))


def _entry(rank: int, world: int, port: int, worker: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.save(globals()[worker](rank, world), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(worker: str, tmp_path) -> list[dict]:
    mp.spawn(_entry, args=(WORLD, free_port(), worker, str(tmp_path)), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


# ----------------------------------------------------------------------------- DDP
def counting(kind: str, model: nn.Module):
    """The optimizer of ``kind`` (:func:`build`), recording the Newton–Schulz FLOPs of the
    matrices it steps on this rank (``flops``)."""
    class Counting(METHODS.get(kind.partition("/")[0], MuonEq)):
        flops = 0.0

        def prepare(self, M, segment, group, out):
            self.flops += M.shape[0] * ns_flops(M.shape[-2:], group["ns_steps"])
            return super().prepare(M, segment, group, out)

    return build(kind, model, Counting)


#: Methods whose FLOPs are counted: MuonEq, and Mousse (state of its own, gradients read)
COUNTED = ["R", "mousse"]


#: (optimizer, distributed=): MuonEq split or not, and every other method split, stacked
DDP_CASES = [("R", "auto"), ("R", False), ("none", "auto"), ("RC/stacked", "auto"),
             *((f"{name}/stacked", "auto") for name in METHODS)]


def ddp_worker(rank: int, world: int) -> dict:
    results = {}
    for kind, split in DDP_CASES:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = build(kind, model, distributed=split)
        train(ddp, opt, STEPS)
        results[(kind, split)] = [p.detach().clone() for p in model.parameters()]
        results[(kind, split, "state")] = matrix_state(model, opt)
    for kind in COUNTED:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = counting(kind, model)
        train(ddp, opt, 1)
        results[("flops", kind)] = opt.flops
    # without DDP the ranks' gradients differ: splitting must refuse
    model = make_model()
    opt = MuonEq(groups(model), lr=0.05)
    x, y = batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
        results["mismatch"] = "no error"
    except RuntimeError as err:
        results["mismatch"] = str(err)
    return results


def ddp_and_fsdp_worker(rank: int, world: int) -> dict:
    """One pair of processes for every layout (process start-up dominates these tests)."""
    return {"ddp": ddp_worker(rank, world), "fsdp": fsdp_worker(rank, world),
            "replicated": replicated_worker(rank, world),
            "layouts": layouts_worker(rank, world), "budgets": budgets_worker(rank, world)}


#: Matrices of the budget runs: per copy, two shapes (one tall, one wide) × 3 matrices each.
BUDGET_SHAPES = [(12, 8)] * 3 + [(8, 20)] * 3
#: Every matrix method, as the registry builds it.
BUDGET_METHODS = ("muoneq", "muon", "muon_plus", "normuon", "adamuon", "mousse")
#: The methods that take ``capturable=True`` (a tensor ``lr`` read on the device).
CAPTURABLE_METHODS = ("muoneq", "muon")


def budgets_worker(rank: int, world: int) -> dict:
    """Each method's step: its aten operations and allocations after the first step, split
    between DDP ranks (replicated parameters with the same gradients) and as FSDP2 row shards,
    stacked for two and six copies of :data:`BUDGET_SHAPES` (float32 Newton–Schulz, whole shapes
    per chunk) and per matrix for two. The allocations of a third step too: Mousse's
    (``precond_every=2``) refreshes its eigenbases there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.helpers.dispatch import dispatched

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    runs = [("stacked", 2), ("stacked", 6), ("per_matrix", 2)]
    capturable = [(method, "stacked", 2, True) for method in CAPTURABLE_METHODS]
    for path, (method, batching, copies, tensor_lr) in itertools.product(
            ("ddp", "fsdp"), [*((m, *run, False) for m in BUDGET_METHODS for run in runs),
                              *capturable]):
        gen = torch.Generator().manual_seed(0)
        values = [torch.randn(s, generator=gen) for s in BUDGET_SHAPES * copies]
        grads = [torch.randn(s, generator=gen) for s in BUDGET_SHAPES * copies]
        place = ((lambda t: t) if path == "ddp"
                 else (lambda t: distribute_tensor(t, mesh, [Shard(0)])))
        params = [nn.Parameter(place(v)) for v in values]
        for p, g in zip(params, grads, strict=True):
            p.grad = place(g)
        lr = {"lr": torch.tensor(0.02), "capturable": True} if tensor_lr else {"lr": 0.02}
        opt = build_optimizer(method, [{"params": params}], ns_dtype="float32",
                              batching=batching, workspace_limit=None, **lr,
                              **METHOD_OPTIONS.get(method, {}))
        opt.step()
        seen, refreshing = dispatched(opt.step), dispatched(opt.step)
        key = (path, method, batching, copies, *(("capturable",) if tensor_lr else ()))
        results[key] = (dict(seen.ops), seen.allocated + refreshing.allocated)
        results[(*key, "weights")] = [
            (p.full_tensor() if path == "fsdp" else p).detach().clone() for p in params]
    return results


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spawned")
    os.environ["MUONEQ_TEST_DCP"] = str(folder / "dcp")
    try:
        return spawn("ddp_and_fsdp_worker", folder)
    finally:
        del os.environ["MUONEQ_TEST_DCP"]


@pytest.fixture(scope="module")
def ddp_results(spawned):
    return [r["ddp"] for r in spawned]


@pytest.fixture(scope="module")
def fsdp_results(spawned):
    return [r["fsdp"] for r in spawned]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind, split", DDP_CASES)
def test_ddp_matches_one_process_on_every_rank(ddp_results, kind, split):
    want = single_process(kind)
    for r in range(WORLD):
        got = ddp_results[r][(kind, split)]
        assert max_rel_diff(got, want) <= TOLERANCE
        for a, b in zip(got, ddp_results[0][(kind, split)], strict=True):
            assert torch.equal(a, b), "ranks must end with identical parameters"


def assert_split_within_the_bound(shares: list[float]) -> None:
    """Every matrix stepped once, by one owner, each rank's share of the FLOPs at most
    total/W plus the largest matrix's."""
    shapes = [(p.shape[0], math.prod(p.shape[1:])) for p in make_model().parameters()
              if p.ndim >= 2]
    costs = [ns_flops(s, 5) for s in shapes]
    assert sum(shares) == pytest.approx(sum(costs))
    assert all(share > 0 for share in shares)
    assert max(shares) <= sum(costs) / WORLD + max(costs)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", COUNTED)
def test_ddp_ranks_split_the_flops_within_the_bound(ddp_results, kind):
    assert_split_within_the_bound([ddp_results[r][("flops", kind)] for r in range(WORLD)])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["RC/stacked", *(f"{name}/stacked" for name in METHODS)])
def test_a_stacked_ddp_run_equals_the_single_process_stacked_run(ddp_results, kind):
    """Owners step contiguous runs of the same plan: every weight bit for bit as one process,
    and every rank's state (a method's own state updated by the owners of its matrices)."""
    want, want_state = single_process(kind, with_state=True)
    for r in range(WORLD):
        for a, b in zip(ddp_results[r][(kind, "auto")], want, strict=True):
            assert torch.equal(a, b)
        for got, state in zip(ddp_results[r][(kind, "auto", "state")], want_state, strict=True):
            assert got.keys() == state.keys()
            for key in state:
                assert torch.equal(got[key], state[key]), key


#: aten operations of a DDP-split and of an FSDP2 stacked step of each method on
#: :data:`BUDGET_SHAPES` (the busier rank's, which steps parts of both shapes; the same for
#: three times the matrices, whose owners cut the same shapes): the one-process step's
#: prologue, the method's rule, Newton–Schulz and update, the copies in and out of the
#: exchange buffers (a method's state travels in them too) and the collectives.
DISTRIBUTED_BUDGETS = {
    "ddp": {"muoneq": 64, "muon": 52, "muon_plus": 78, "normuon": 83, "adamuon": 100,
            "mousse": 139},
    "fsdp": {"muoneq": 78, "muon": 64, "muon_plus": 91, "normuon": 107, "adamuon": 135,
             "mousse": 237},
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method", BUDGET_METHODS)
@pytest.mark.parametrize("path", ["ddp", "fsdp"])
def test_a_distributed_step_keeps_its_budget_and_allocates_nothing(spawned, path, method):
    for r in range(WORLD):
        (ops, allocated), (more_ops, more_allocated), (_, per_matrix) = (
            spawned[r]["budgets"][(path, method, batching, copies)]
            for batching, copies in [("stacked", 2), ("stacked", 6), ("per_matrix", 2)])
        assert allocated == [] and more_allocated == [] and per_matrix == []
        assert ops == more_ops, "the operations grow with the shapes, not with the matrices"
        assert sum(ops.values()) <= DISTRIBUTED_BUDGETS[path][method], ops


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("method", CAPTURABLE_METHODS)
@pytest.mark.parametrize("path", ["ddp", "fsdp"])
def test_a_capturable_distributed_step_allocates_nothing_and_equals_the_float_lr_step(
        spawned, path, method):
    """A tensor ``lr`` (``capturable=True``): ``−a·η`` computed on the device into buffers of the
    plan, nothing allocated after the first step, within the float step's budget plus line
    13's ``1 − η·λ`` on the device (3 operations) and, per shape, ``−a·η`` and its product with
    the directions; and the weights of the same steps with ``lr`` a float."""
    extra = 3 + 2 * len(set(BUDGET_SHAPES))
    for r in range(WORLD):
        ops, allocated = spawned[r]["budgets"][(path, method, "stacked", 2, "capturable")]
        assert allocated == []
        assert sum(ops.values()) <= DISTRIBUTED_BUDGETS[path][method] + extra, ops
        got = spawned[r]["budgets"][(path, method, "stacked", 2, "capturable", "weights")]
        want = spawned[r]["budgets"][(path, method, "stacked", 2, "weights")]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_split_refuses_ranks_with_different_gradients(ddp_results):
    for r in range(WORLD):
        assert "gradients differ across ranks" in ddp_results[r]["mismatch"]
        assert "distributed=False" in ddp_results[r]["mismatch"]


# ----------------------------------------------------------------------------- replicated DTensors
#: (optimizer, distributed=) of a model whose parameters are replicated ``DTensor``\ s (a
#: tensor-parallel model's replicated parameters): split as DDP's or not, per matrix and stacked,
#: and a method with state of its own that reads the gradients
REPLICATED_CASES = [("R", "auto"), ("R", False), ("RC/stacked", "auto"),
                    ("mousse/stacked", "auto")]


def replicated_worker(rank: int, world: int) -> dict:
    """Every parameter ``distribute_tensor(w, mesh, [Replicate()])`` (``distribute_module``'s
    default), the inputs replicated alike: every rank computes the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )

    mesh = init_device_mesh("cpu", (world,))

    def replicated(x):
        return DTensor.from_local(x, mesh, [Replicate()])

    results = {}
    for kind, split in REPLICATED_CASES:
        model = make_model()
        distribute_module(model, mesh, input_fn=lambda _, inputs, __: tuple(
            replicated(x) for x in inputs))
        opt = build(kind, model, distributed=split)
        for t in range(STEPS):
            x, y = batch(t)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), replicated(y)).backward()
            opt.step()
        results[(kind, split)] = [p.full_tensor().detach().clone() for p in model.parameters()]
        results[(kind, split, "state")] = matrix_state(model, opt)
        results[(kind, split, "replicated")] = [
            isinstance(t, DTensor) and t.placements == (Replicate(),)
            for p in model.parameters() if p.ndim >= 2 for t in opt.state[p].values()]
    mixed = [nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [placement]))
             for placement in (Shard(0), Replicate())]
    try:
        MuonEq(mixed)
        results["mixed"] = "no error"
    except ValueError as err:
        results["mixed"] = str(err)
    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind, split", REPLICATED_CASES)
def test_replicated_dtensor_parameters_step_as_plain_tensors(spawned, kind, split):
    """The weights and the state as one process's plain-tensor run ends, bit for bit (the ranks
    compute the same gradients; owners step contiguous runs of the same plan), the state a
    replicated ``DTensor`` as its parameter (what distributed checkpoints save)."""
    want, want_state = single_process(kind, with_state=True)
    for r in range(WORLD):
        got = spawned[r]["replicated"]
        for a, b in zip(got[(kind, split)], want, strict=True):
            assert torch.equal(a, b)
        for state, expected in zip(got[(kind, split, "state")], want_state, strict=True):
            assert state.keys() == expected.keys()
            for key in expected:
                assert torch.equal(state[key], expected[key]), key
        assert all(got[(kind, split, "replicated")])


@pytest.mark.distributed
@pytest.mark.slow
def test_a_group_mixing_row_shards_and_replicated_dtensors_is_refused(spawned):
    for r in range(WORLD):
        assert spawned[r]["replicated"]["mixed"].startswith(
            "params: a matrix group mixes row-sharded DTensor parameters")


# ----------------------------------------------------------------------------- FSDP2
FSDP_CASES = ["R", "RC/stacked", "none", *(f"{name}/stacked" for name in METHODS)]


def fsdp_worker(rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded_model():
        model = make_model()
        for layer in model:
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def full(model):
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    results = {}
    for kind in FSDP_CASES:
        model = sharded_model()
        opt = build(kind, model)
        train(model, opt, STEPS)
        results[kind] = full(model)
        results[(kind, "state")] = matrix_state(model, opt)
        if kind == "R":
            layouts = []
            for p in model.parameters():
                buf = opt.state[p]["momentum_buffer"] if p.ndim >= 2 else opt.state[p]["exp_avg"]
                layouts.append(isinstance(buf, DTensor) and buf.placements == (Shard(0),)
                               and buf.to_local().shape == p.to_local().shape)
            results["momentum_sharded"] = layouts
        if kind == "mousse/stacked":  # its own state: by its rows, the counts replicated
            results["state_sharded"] = [
                isinstance(t, DTensor) and t.placements == ((Shard(0),) if t.ndim
                                                            else (Replicate(),))
                and t.to_local().shape == (
                    (shard_rows(t.shape[0], world)[rank][1], *t.shape[1:]) if t.ndim else ())
                for p in model.parameters() if p.ndim >= 2
                for key, t in opt.state[p].items() if key != "momentum_buffer"]

    for kind in COUNTED:
        model = sharded_model()
        opt = counting(kind, model)
        train(model, opt, 1)
        results[("flops", kind)] = opt.flops

    # distributed checkpoint: save after 2 steps, resume in fresh objects, compare
    for kind in DCP_CASES:
        model = sharded_model()
        opt = build(kind, model)
        train(model, opt, 2)
        model_sd, optim_sd = get_state_dict(model, opt)
        ckpt = os.path.join(os.environ["MUONEQ_TEST_DCP"], kind.replace("/", "_"))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        train(model, opt, 2, first=2)
        results[(kind, "straight")] = full(model)
        resumed = sharded_model()
        opt2 = build(kind, resumed)
        model_sd, optim_sd = get_state_dict(resumed, opt2)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(resumed, opt2, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        train(resumed, opt2, 2, first=2)
        results[(kind, "resumed")] = full(resumed)
    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", FSDP_CASES)
def test_fsdp2_matches_one_process(fsdp_results, kind):
    """The weights, and the state gathered whole (a method's own included: updated by the
    owners of its matrices, sharded by rows), as one process ends."""
    want, want_state = single_process(kind, with_state=True)
    for r in range(WORLD):
        assert max_rel_diff(fsdp_results[r][kind], want) <= TOLERANCE
        for got, state in zip(fsdp_results[r][(kind, "state")], want_state, strict=True):
            assert got.keys() == state.keys()
            for key in state:
                assert max_rel_diff([got[key]], [state[key]]) <= TOLERANCE, key


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_state_is_sharded_like_its_parameter(fsdp_results):
    """The momentum as its parameter; a method's own state by the rows of its own first
    dimension (Mousse's ``R``, ``Q_R``: ``n × n``), its step counts replicated."""
    for r in range(WORLD):
        assert all(fsdp_results[r]["momentum_sharded"])
        assert all(fsdp_results[r]["state_sharded"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", COUNTED)
def test_fsdp2_owners_split_the_flops_within_the_bound(fsdp_results, kind):
    assert_split_within_the_bound([fsdp_results[r][("flops", kind)] for r in range(WORLD)])


#: Runs saved with ``torch.distributed.checkpoint`` and resumed: MuonEq, and Mousse (state of
#: every layout: sharded by its rows, ``n × n``, replicated step counts)
DCP_CASES = ["RC", "mousse/stacked"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", DCP_CASES)
def test_fsdp2_distributed_checkpoint_round_trip(fsdp_results, kind):
    want = single_process(kind, steps=4)
    for r in range(WORLD):
        for a, b in zip(fsdp_results[r][(kind, "resumed")], fsdp_results[r][(kind, "straight")],
                        strict=True):
            assert torch.equal(a, b)
        assert max_rel_diff(fsdp_results[r][(kind, "straight")], want) <= TOLERANCE


# ----------------------------------------------------------------------------- stored layouts
#: Stored layouts across the DDP split and FSDP2 row shards: blocks that straddle two ranks'
#: rows (8 + 2 + 2 outputs over 2 × 6 rows), a transposed weight whose rows are its inputs, an
#: expert bank sharded 2 + 1 experts.
LAYOUT_CASES = [c for c in CASES if c.id in ("gqa_qkv", "conv1d_qkv", "experts_transposed",
                                             "experts_gate_up", "conv_transpose")]
LAYOUT_BATCHING = ("per_matrix", "stacked")
#: how the ranks hold the parameter: whole tensors, row shards, replicated DTensors
LAYOUT_PATHS = ("ddp", "fsdp", "replicated")


def layout_optimizer(groups, batching: str):
    return MuonEq(groups, lr=0.02, weight_decay=0.1, mode="RC", ns_dtype=torch.float32,
                  batching=batching)


#: Transposed one-matrix layouts under the methods with state of their own (stacked): state in
#: the matrix view, whose rows are the stored columns, and Mousse's gradients staged oriented.
METHOD_LAYOUT_CASES = [c for c in CASES if c.id in ("conv1d", "conv_transpose")]
METHOD_LAYOUT_METHODS = ("adamuon", "mousse")


def method_optimizer(groups, method: str):
    return build_optimizer(method, groups, lr=0.02, ns_dtype="float32", batching="stacked",
                           **METHOD_OPTIONS.get(method, {}))


def layouts_worker(rank: int, world: int) -> dict:
    """Each case under the DDP split (the same gradients on every rank, as DDP leaves them),
    as FSDP2 row shards (``Shard(0)`` DTensors) and as replicated DTensors (split as DDP's),
    per matrix and stacked; and the method cases. One parameter: one rank owns it, the other
    steps nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    runs = [*((case, functools.partial(layout_optimizer, batching=batching), batching)
              for case in LAYOUT_CASES for batching in LAYOUT_BATCHING),
            *((case, functools.partial(method_optimizer, method=method), method)
              for case in METHOD_LAYOUT_CASES for method in METHOD_LAYOUT_METHODS)]
    results = {}
    placements = {"fsdp": [Shard(0)], "replicated": [Replicate()]}
    for (case, make, name), path in itertools.product(runs, LAYOUT_PATHS):
        def place(t, path=path):
            return t if path == "ddp" else distribute_tensor(t, mesh, placements[path])

        p = nn.Parameter(place(case.stored(initial_blocks(case))))
        opt = make([{"params": [p], **case.keys}])
        for t in range(STEPS):
            p.grad = place(case.stored(block_grads(case, t)))
            opt.step()
        whole = p.detach() if path == "ddp" else p.detach().full_tensor()
        results[(case.id, name, path)] = whole.clone()
    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c.id for c in LAYOUT_CASES])
@pytest.mark.parametrize("batching", LAYOUT_BATCHING)
@pytest.mark.parametrize("path", LAYOUT_PATHS)
def test_stored_layouts_match_separate_matrices_on_one_process(spawned, case, batching, path):
    with one_thread():
        want = run_separate(case, lambda groups: layout_optimizer(groups, batching))
    for r in range(WORLD):
        got = spawned[r]["layouts"][(case.id, batching, path)]
        assert max_rel_diff([got], [want]) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", METHOD_LAYOUT_CASES, ids=[c.id for c in METHOD_LAYOUT_CASES])
@pytest.mark.parametrize("method", METHOD_LAYOUT_METHODS)
@pytest.mark.parametrize("path", LAYOUT_PATHS)
def test_methods_on_transposed_layouts_match_one_process(spawned, case, method, path):
    with one_thread():
        want = run_separate(case, functools.partial(method_optimizer, method=method))
    for r in range(WORLD):
        assert max_rel_diff([spawned[r]["layouts"][(case.id, method, path)]], [want]) <= TOLERANCE


# ----------------------------------------------------------------------------- Lightning
LIGHTNING_SCRIPT = textwrap.dedent(
    """
    import sys
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from torch.distributed.fsdp import fully_shard
    from tests.test_distributed import STEPS, batch, build, make_model

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, xy, _):
            x, y = xy
            return torch.nn.functional.mse_loss(self.net(x[0]), y[0])

        def configure_optimizers(self):
            return build("R", self.net)

    torch.set_num_threads(1)
    module = Module()
    trainer = L.Trainer(
        accelerator="cpu", devices=2,
        strategy=L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2,
                                                           tensor_parallel_size=1),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader([batch(t) for t in range(STEPS)], batch_size=1))
    params = [p.full_tensor().detach().clone() for p in module.net.parameters()]
    if trainer.global_rank == 0:
        torch.save(params, sys.argv[1])
    # left to the interpreter's exit, gloo's threads can abort it (SIGABRT after a good fit)
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.distributed
@pytest.mark.slow
def test_lightning_model_parallel_strategy_matches_one_process(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_SCRIPT)
    out = tmp_path / "params.pt"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert max_rel_diff(torch.load(out), single_process("R")) <= TOLERANCE


# ----------------------------------------------------------------------------- planning
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balance_keeps_every_rank_within_total_over_world_plus_largest(world):
    gen = torch.Generator().manual_seed(world)
    shapes = [tuple(int(v) for v in torch.randint(1, 300, (2,), generator=gen))
              for _ in range(37)]
    costs = [ns_flops(s, 5) for s in shapes]
    owners = balance(costs, world)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
    assert max(loads) <= sum(costs) / world + max(costs)
    assert owners == balance(costs, world), "every rank must compute the same plan"
    gpt2 = [ns_flops(s, 5) for s in [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12]
    loads = [0.0] * world
    for c, o in zip(gpt2, balance(gpt2, world), strict=True):
        loads[o] += c
    assert max(loads) <= sum(gpt2) / world + max(gpt2)


@pytest.mark.parametrize("rows", [1, 5, 9, 16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_rows_is_the_dtensor_shard0_layout(rows, world):
    from torch.distributed.tensor import Shard

    pieces, _ = Shard(0)._split_tensor(torch.arange(rows), world, with_padding=False)
    layout = shard_rows(rows, world)
    assert [length for _, length in layout] == [len(p) for p in pieces]
    assert [int(p[0]) for p in pieces if len(p)] == [s for s, n in layout if n]
