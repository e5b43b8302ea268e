"""CUDA checks (skipped without a GPU): the accelerator paths against the CPU's, torch's Muon on
the same device, and the benchmark recording the device."""

import json

import pytest
import torch
import yaml
from torch import nn

from muoneq import MuonEq
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
