"""CUDA checks (skipped without a GPU): the accelerator paths against the CPU's, torch's Muon on
the same device, this project's Triton kernels compiled for the device against torch's products,
``capturable=True`` in a captured CUDA graph, ``compile=True`` on the stacked path, a sweep of
warm trials on one GPU each, and the benchmark recording the device. Written against the public
API (the optimizers' arguments, ``newton_schulz``'s backends, ``ns_triton.iterate_stack``); the
kernel checks that Triton's interpreter can run also run on a CPU (``test_gpu_on_cpu.py``)."""

import json
import math

import pytest
import torch
import yaml
from torch import nn

from muoneq import MuonEq
from muoneq.newton_schulz import newton_schulz
from tests.helpers import gpu
from tests.helpers.gpu import ns5_errors
from tests.helpers.layout import CASES, run_separate, run_stored

pytestmark = pytest.mark.gpu

SHAPES = [(96, 32)] * 3 + [(32, 96), (48, 48), (16, 8, 3, 3)]


def steps_of(make_opt, device, dtype=torch.float32, shapes=SHAPES, steps=3):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]
    params = [nn.Parameter(v.to(device)) for v in values]
    opt = make_opt(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("mode", ["none", "R", "C", "RC"])
def test_stacked_cuda_path_equals_the_cpu_path_in_float64(mode, algorithm):
    def make(params):
        return MuonEq(params, lr=0.05, mode=mode, ns_dtype="float64", ns_algorithm=algorithm)

    cuda = steps_of(make, "cuda", torch.float64)  # batching="auto": stacked on accelerators
    cpu = steps_of(make, "cpu", torch.float64)
    for a, b in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_mode_none_per_matrix_is_torch_muon_on_cuda(nesterov):
    flat = [s for s in SHAPES if len(s) == 2]  # torch.optim.Muon takes matrices only
    ours = steps_of(lambda ps: MuonEq(ps, lr=0.02, mode="none", nesterov=nesterov,
                                      batching="per_matrix"), "cuda", shapes=flat)
    theirs = steps_of(lambda ps: torch.optim.Muon(ps, lr=0.02, nesterov=nesterov,
                                                  adjust_lr_fn="match_rms_adamw"), "cuda",
                      shapes=flat)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_newton_schulz_on_cuda_is_as_accurate_as_on_cpu():
    errors = ns5_errors("cuda")  # both sides in bf16, the GPU's default (CPU's: float32)
    for algorithm in ("standard", "gram"):
        assert errors[algorithm] <= 1.5 * errors["cpu"]


def test_benchmark_records_the_gpu(tmp_path):
    from muoneq.suite.benchmarks.bench_step import main

    out = tmp_path / "bench.json"
    assert main(["--quick", "--sets", "gpt2_small", "--repeats", "1", "--device", "cuda",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == torch.cuda.get_device_name()
    rows = result["sets"]["gpt2_small"]["contenders"]
    assert "MuonEq-R (per_matrix)" in rows and rows["MuonEq-R"]["ms"] > 0


def test_tiny_language_run_on_cuda_in_bf16_reports_mfu(tmp_path):
    from muoneq.suite.runtime import compose, train
    from tests.helpers.runtime import tiny_language

    cfg = compose(["experiment=llama_tiny_shakespeare", *tiny_language(tmp_path),
                   "trainer.accelerator=cuda", "trainer.devices=1", "trainer.precision=bf16-mixed",
                   "trainer.max_steps=4", "schedule.total_steps=4", "task.peak_tflops=100",
                   f"run.dir={tmp_path / 'run'}"])
    metrics = train(cfg)
    assert metrics["status"] == "finished" and metrics["global_step"] == 4
    assert metrics["final"] is not None and 0 < metrics["mfu"] < 1
    assert metrics["peak_memory_kind"] != "host_rss"
    # trainer.compile=auto (the default) compiled it: CUDA, with Triton (a GPU machine's torch)
    provenance = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["provenance"]
    assert provenance["resolved"]["compile"] is True


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_stored_layouts_on_cuda_update_each_block_as_a_separate_linear(case):
    """Transposed weights, expert banks and fused splits on the accelerator default (stacked,
    bf16): exactly the separate matrices' update on the same device."""
    def make(groups):
        return MuonEq(groups, lr=0.02, weight_decay=0.1, mode="RC")

    assert torch.equal(run_stored(case, make, device="cuda"),
                       run_separate(case, make, device="cuda"))


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_triton_backends_on_cuda_step_as_torchs_within_bf16_rounding(backend):
    pytest.importorskip("triton")

    def make(backend):
        return lambda ps: MuonEq(ps, lr=0.02, mode="R", ns_backend=backend)

    ours, theirs = steps_of(make(backend), "cuda"), steps_of(make("torch"), "cuda")
    for a, b in zip(ours, theirs, strict=True):  # three steps of 0.02·0.2·√96 each
        assert (a - b).abs().max() < 3 * 0.02 * 0.2 * 96**0.5 * 2e-2


def test_auto_keeps_the_gram_order_where_the_flop_rule_chose_it():
    """``ns_backend="auto"`` times torch against Triton on the standard order only: a chunk the
    FLOP rule gave the Gram order keeps it (its buffers are the Gram order's), and steps as
    ``ns_backend="torch"`` does, within bf16 rounding (the square matrix may run on Triton)."""
    pytest.importorskip("triton")

    def make(backend):
        return lambda ps: MuonEq(ps, lr=0.02, ns_algorithm="gram", ns_backend=backend)

    ours, theirs = steps_of(make("auto"), "cuda"), steps_of(make("torch"), "cuda")
    for a, b in zip(ours, theirs, strict=True):  # three steps of 0.02·0.2·√96 each
        assert (a - b).abs().max() < 3 * 0.02 * 0.2 * 96**0.5 * 2e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_stacked_cuda_step_allocates_no_device_memory_after_the_first(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = MuonEq(params, lr=0.02, ns_backend=backend)
    opt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


# ----------------------------------------------------------------------------- Triton kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", gpu.KERNEL_STACKS + gpu.KERNEL_STACKS_FULL, ids=str)
def test_a_newton_schulz_step_in_the_compiled_kernels_is_torchs_within_rounding(shape, dtype):
    pytest.importorskip("triton")
    assert gpu.triton_step_units(shape, dtype, "cuda") <= gpu.STEP_UNITS[dtype]


@pytest.mark.parametrize("shape", gpu.KERNEL_STACKS[:2] + gpu.KERNEL_STACKS_FULL, ids=str)
def test_bf16_ns5_in_the_compiled_kernels_meets_the_accuracy_rule(shape):
    pytest.importorskip("triton")
    errors = gpu.triton_ns5_errors(shape, "cuda")
    assert errors["triton"] <= 1.5 * errors["torch"], errors


def test_the_compiled_kernels_address_stacks_past_2_31_elements():
    """A stack whose matrices lie past element 2³¹ (64-bit offsets in the kernels): three
    matrices 2³⁰ elements apart, and a contiguous bf16 stack of 8,194 matrices of 64×4096
    (2.15·10⁹ elements, 4.3 GB; ~13 GB with the normalized copy and the iterate's second
    buffer) through ``newton_schulz``, its first and last matrices against torch's."""
    pytest.importorskip("triton")
    assert gpu.far_apart_stack_distance("cuda") <= gpu.NS5_AGREEMENT
    m, n = 64, 4096
    G = torch.randn(2**31 // (m * n) + 2, m, n, device="cuda", dtype=torch.bfloat16)
    assert G.numel() > 2**31
    ends = [0, len(G) - 2, len(G) - 1]
    want = newton_schulz(G[ends], 5, "quintic", torch.bfloat16, backend="torch")
    got = newton_schulz(G, 5, "quintic", torch.bfloat16, backend="triton")[ends]
    assert gpu.relative_distance(got, want) <= gpu.NS5_AGREEMENT


# ----------------------------------------------------------------------------- capturable
def capturable_twin(lr: float = 0.02):
    """MuonEq with ``capturable=True`` on CUDA (matrices stacked, vectors on AdamW), its ``lr``
    and ``weight_decay`` device tensors, every gradient a fixed tensor the step reads."""
    gen = torch.Generator().manual_seed(0)
    matrices = [nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in SHAPES]
    vectors = [nn.Parameter(torch.randn(8, generator=gen).cuda()) for _ in range(2)]
    lr_t, decay = torch.tensor(lr, device="cuda"), torch.tensor(0.1, device="cuda")
    opt = MuonEq([{"params": matrices}, {"params": vectors, "use_muon": False}], lr=lr_t,
                 weight_decay=decay, capturable=True)
    params = matrices + vectors
    for p in params:
        p.grad = torch.zeros_like(p)
    return params, opt, lr_t


def gradients(params, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).cuda() for p in params]


def test_a_capturable_step_captured_in_a_cuda_graph_replays_as_eager():
    """The step captured once (after warm-up steps on a side stream, as for torch's capturable
    optimizers) and replayed with new gradients and a new lr written in place gives the
    weights of the same steps run eagerly."""
    graphed, eager = capturable_twin(), capturable_twin()
    (g_params, g_opt, g_lr), (e_params, e_opt, e_lr) = graphed, eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for seed in range(3):  # warm-up: the plan, the workspace, the state
            for twin_params, opt in ((g_params, g_opt), (e_params, e_opt)):
                for p, g in zip(twin_params, gradients(twin_params, seed), strict=True):
                    p.grad.copy_(g)
                opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_opt.step()
    captured = [p.detach().clone() for p in g_params]  # capturing runs nothing
    for seed, lr in ((3, 0.02), (4, 0.01), (5, 0.005)):
        grads = gradients(g_params, seed)
        for lr_t, twin_params in ((g_lr, g_params), (e_lr, e_params)):
            lr_t.fill_(lr)
            for p, g in zip(twin_params, grads, strict=True):
                p.grad.copy_(g)
        graph.replay()
        e_opt.step()
    torch.cuda.synchronize()
    # the same kernels on the same numbers; were cuBLAS to pick other algorithms under capture,
    # bf16 rounding (2 % of an update of 0.02·0.2·√96) a step at most
    bound = 3 * 0.02 * 0.2 * 96**0.5 * 2e-2
    for a, b in zip(g_params, e_params, strict=True):
        assert (a - b).abs().max() <= bound
    # and the replays stepped: the matrices moved by far more than that from the capture
    for before, after in zip(captured[:len(SHAPES)], g_params, strict=False):
        assert (after - before).abs().max() > 10 * bound


# ----------------------------------------------------------------------------- compile
def test_compile_on_the_stacked_path_steps_as_eager_and_compiles_once():
    """``compile=True`` (the stacked path, CUDA's default): the weights of eager steps within
    bf16 Newton–Schulz rounding, and nothing compiled after the first step."""
    import torch._dynamo

    def make(compile):
        return lambda ps: MuonEq(ps, lr=0.02, mode="R", compile=compile)

    ours, eager = steps_of(make(True), "cuda"), steps_of(make(False), "cuda")
    for a, b in zip(ours, eager, strict=True):  # three steps of 0.02·0.2·√96 each
        assert (a - b).abs().max() < 3 * 0.02 * 0.2 * 96**0.5 * 2e-2
    params = [nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    opt = make(True)(params)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            opt.step()


# ----------------------------------------------------------------------------- warm trials
@pytest.mark.slow
def test_a_sweep_of_warm_trials_trains_each_on_its_own_gpu(tmp_path):
    """Two trials of ``trainer=gpu`` forked by a warm server (which imported the runtime but
    never CUDA), one device each: each forked trial initializes CUDA itself, trains and records
    the GPU."""
    from muoneq.suite.sweeps import Driver, launch
    from muoneq.suite.sweeps.driver import device_slots
    from muoneq.suite.sweeps.spec import spec_from_dict
    from tests.helpers.runtime import tiny_language
    from tests.helpers.sweeps import options

    overrides = [o for o in tiny_language(tmp_path) if not o.startswith("trainer=")]
    spec = spec_from_dict({
        "study": "warm-gpu", "experiment": "llama_tiny_shakespeare", "seeds": [0, 1],
        "overrides": ["trainer=gpu", *overrides, "trainer.compile=false",
                      "trainer.max_steps=4", "task.val_every_n_steps=2"],
        "grid": [{"optimizer": ["muoneq_nes"], "optimizer.lr": [0.02]}],
        "objective": {"metric": "val/ppl"},
        "launch": {"warm": "true", "devices_per_trial": 1}})
    assert len(device_slots(spec.launch, 1, None)[0]) == 1  # one CUDA device per trial
    assert Driver(spec, options(tmp_path)).run().done == 2
    for seed in (0, 1):
        run_dir = spec.points()[0].run_dir(tmp_path / "runs" / spec.study, seed)
        record = json.loads((run_dir / launch.RECORD_NAME).read_text())
        assert record["process"].startswith("forked by the warm server")
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["global_step"] == 4
        assert metrics["world_size"] == 1
        assert metrics["device"] == torch.cuda.get_device_name(0)
        assert metrics["peak_memory_kind"] == "device_allocated"
        assert math.isfinite(metrics["val/ppl"])
