"""Check every GPU path in one command and record what it measured: ``muoneq gpu-check``
(``make gpu-check``).

Seven parts, run in this order; a part that fails is recorded and the next one still runs, and
the results are written again after every part (a kill loses no finished part):

1. ``tests``: ``pytest -m gpu tests`` (the CUDA checks; they skip without a GPU);
2. ``bench``: ``muoneq bench --compile --peers without`` on the device: the four matrix sets,
   every contender of this project (our Muon, MuonEq R/C/RC, the Gram order, the other batching
   path, the Triton and ``auto`` backends, ``compile=True``) and ``torch.optim.Muon``, and the
   accuracy rule; and what ``ns_backend="auto"`` chose per shape, with both backends timed
   (:func:`auto_choices`);
3. ``peers``: ``muoneq bench --peers only``: the public Muon implementations installed here
   (``muoneq[bench]``) beside ``torch.optim.Muon``, our Muon and MuonEq-R, on the GPT-2,
   LLaMA2-130M and GPT-2-block sets (:data:`PEER_SETS`);
4. ``gpt2``: GPT2-small at the recipe's shapes (``conf/experiment/gpt2_small_fineweb.yaml``:
   4,096-token sequences, global batch 128 = 16 micro-batches of 8) trained for a few steps on
   synthetic tokens, eager and with ``trainer.compile=true``: tokens/s, MFU, and the
   optimizer's share of a step (``optimizer.step()`` timed inside training at the recipe's
   global batch);
5. ``llama130m``: the same for LLaMA2-130M at its recipe's shapes (``llama130m_c4``: 4,096-token
   sequences, global batch 128 = 16 micro-batches of 8);
6. ``resnet``: one epoch of the CIFAR-10 recipe (ResNet-18, batch 128) with channels-last
   weights on synthetic CIFAR-shaped images (50,000 training, 10,000 test), timed, and where a
   step of it goes: forward and backward, ``optimizer.step()`` alone, the whole step and the
   kernels of one optimizer step (torch.profiler), on one batch already on the device; the
   optimizer's share of the step, and the loop's overhead (the epoch's time per step over the
   whole step's);
7. ``fsdp2``: LLaMA2-1B built and trained for 2 steps under FSDP2 on one device, one
   micro-batch per step (a build check: sharding, the sharded optimizer step, the distributed
   checkpoint); out of memory is recorded as "did not fit".

Training parts go through :func:`muoneq.suite.runtime.train` with the recipes' configs, so they run
what ``muoneq train`` runs, on the synthetic data their task writes
(:attr:`muoneq.suite.runtime.tasks.TaskSpec.synthetic_data`: this module reaches the workloads
through the task registry only). On CUDA they train in ``bf16-mixed`` and MFU is against the
device's dense bf16 datasheet peak (:data:`muoneq.suite.runtime.accelerators.PEAK_TFLOPS`) or,
for a GPU not listed there, against a bf16 matmul rate measured here. On a CPU they train in
``32-true`` (bf16 matmuls are an order of magnitude slower than float32 on many CPUs) and MFU is
against a float32 matmul rate measured here; the results say which.

Every figure is compared with its target, where the GPU-speed work set one (:data:`FIGURES`),
in one table of the summary.

On a full run every part runs in a process of its own, stopped (with everything it started)
at its limit (:data:`PART_LIMITS`; ``--part-timeout S``: S seconds each, ``none``: every part
in this process): a part that hangs is recorded as ``timed out`` and the next part runs.

``--quick`` shrinks every part to a miniature (tiny models, short sequences, the bench's
quick sets, no ``torch.compile``): its figures are smoke values, used by the test suite
(``make gpu-check DEVICE=cpu QUICK=1``). A CPU runs only ``--quick``: the recipes' shapes take
hours there.

Output: ``<out>/<device-slug>.json`` (``<device-slug>-quick.json`` with ``--quick``; a failed
part keeps its one-line error and traceback there, a part cut short by a kill stays
``started``) and a Markdown summary beside it. Parts not run this time (``--parts``) are kept
from an earlier file of the same name, each with its own date and commit, so a check split over
two machine sessions ends in one file. The commit recorded is ``$MUONEQ_GIT_COMMIT`` when set,
else that of the checkout this code lies in, if it is a git checkout of its own
(:func:`muoneq.suite.code_version.taken`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from muoneq.functional import matrix_shape
from muoneq.newton_schulz import QUINTIC, auto_candidates, buffers_for, time_iterations
from muoneq.suite import code_version
from muoneq.suite.benchmarks.bench_step import (
    MATRIX_SETS,
    device_label,
    operations,
    sig3,
)
from muoneq.suite.benchmarks.bench_step import main as bench_main
from muoneq.suite.benchmarks.bench_step import table as bench_table
from muoneq.suite.files import atomic_write, slug
from muoneq.suite.folders import CHECKOUT
from muoneq.suite.machine import device_name
from muoneq.suite.runtime import compose, train
from muoneq.suite.runtime.accelerators import device_peak_tflops, synchronize
from muoneq.suite.runtime.optim import build_optimizer_from_config
from muoneq.suite.runtime.record import session
from muoneq.suite.runtime.tasks import get_task

RESULTS_DIR = Path("benchmarks/results")

#: Vocabulary of the recipes' tokenizers (synthetic tokens are drawn below it; no tokenizer
#: file is needed, so the check runs offline).
TOKENIZER_VOCAB = {"gpt2": 50257, "hf:google-t5/t5-base": 32100}

#: Optimizer steps of the training parts (the first is warm-up: StepStats does not time it).
LANGUAGE_STEPS, FSDP2_STEPS = 4, 2
#: Timed calls (median) and warm-up calls of each piece of the ResNet-18 step breakdown.
BREAKDOWN_CALLS, QUICK_BREAKDOWN_CALLS = (30, 10), (5, 2)


@dataclasses.dataclass
class Check:
    """What every part needs: the device, the mode and a scratch folder."""

    device: torch.device
    quick: bool
    work: Path

    @property
    def precision(self) -> str:
        return "bf16-mixed" if self.device.type == "cuda" else "32-true"

    def trainer_overrides(self, strategy: str = "single") -> list[str]:
        """One device of this check's kind, quiet, in this check's precision, eager (a part that
        compiles says so after these: the earlier records' ResNet and FSDP2 parts ran eager)."""
        trainer = ["trainer=fsdp2"] if strategy == "fsdp2" else ["trainer.strategy=single"]
        return [*trainer, f"trainer.accelerator={self.device.type}", "trainer.devices=1",
                f"trainer.precision={self.precision}", "trainer.progress=quiet",
                "trainer.compile=false"]


def device_slug(name: str) -> str:
    """A file name from a device name: ``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3``."""
    return slug(name.lower(), keep="a-z0-9", sep="-", empty="device")


def results_path(out: Path, device: torch.device, quick: bool) -> Path:
    return Path(out) / f"{device_slug(device_name(device))}{'-quick' if quick else ''}.json"


# ----------------------------------------------------------------------------- peak FLOP/s
def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Median rate of an ``n×n`` by ``n×n`` product on random data, in TFLOP/s
    (``torch.utils.benchmark`` synchronizes CUDA and uses torch's CPU threads)."""
    from torch.utils import benchmark

    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    timer = benchmark.Timer("torch.mm(a, b)", globals={"torch": torch, "a": a, "b": b},
                            num_threads=torch.get_num_threads())
    return 2 * n**3 / timer.blocked_autorange(min_run_time=1.0).median / 1e12


def mfu_peak(check: Check) -> dict:
    """The peak that MFU is measured against: the dense bf16 datasheet peak of a GPU the
    language task knows, else a matmul rate measured here in the training dtype (the measured
    rate is kept either way)."""
    dtype = torch.bfloat16 if check.precision.startswith("bf16") else torch.float32
    n = 8192 if check.device.type == "cuda" else 1024
    measured = matmul_tflops(check.device, dtype, n)
    what = f"{str(dtype).removeprefix('torch.')} {n}×{n} matmul measured here"
    datasheet = device_peak_tflops(check.device)
    if datasheet is not None:
        return {"tflops": datasheet, "datasheet": True,
                "source": "the device's dense bf16 datasheet peak",
                "measured_matmul_tflops": measured, "measured_matmul": what}
    return {"tflops": measured, "datasheet": False,
            "source": f"the {what}: no datasheet peak is known for this device",
            "measured_matmul_tflops": measured, "measured_matmul": what}


# ----------------------------------------------------------------------------- helpers
class OptimizerStepTimer(L.Callback):
    """Times the optimizer's own work in every ``optimizer.step()`` of a run: from the end of
    the closure Lightning passes (the last micro-batch's forward and backward, and gradient
    clipping, run inside ``step``) to the end of ``step``, the device synchronized at both
    ends (torch's step hooks). The first step, warm-up, is left out of the median."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        device = pl_module.device

        def start() -> None:
            synchronize(device)
            self._start = time.perf_counter()

        def before(optimizer, args, kwargs):  # args: (optimizer, [closure])
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is None:
                start()
                return None

            def timed_closure():
                loss = closure()
                start()
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": timed_closure}
            return (args[0], timed_closure, *args[2:]), kwargs

        def after(optimizer, args, kwargs):
            synchronize(device)
            self.seconds.append(time.perf_counter() - self._start)

        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(before)
            optimizer.register_step_post_hook(after)

    def median(self) -> float | None:
        timed = self.seconds[1:]
        return statistics.median(timed) if timed else None


class ChannelsLast(L.Callback):
    """Puts the network in channels-last memory format before it moves to the device (conv
    weights, hence activations, NHWC) and checks that it is still so when training starts."""

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.model.to(memory_format=torch.channels_last)

    def on_train_start(self, trainer, pl_module) -> None:
        convs = [p for p in pl_module.model.parameters() if p.ndim == 4]
        if not all(p.is_contiguous(memory_format=torch.channels_last) for p in convs):
            raise RuntimeError("conv weights left channels-last before training started")


class EpochTimer(L.Callback):
    """The training epoch's time per optimizer step, the first step (warm-up) left out: from
    the end of the first step to the end of the epoch (device synchronized at both ends; data
    loading, Lightning's per-step work and callbacks included). One micro-batch per step."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = math.nan
        self._start = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            synchronize(pl_module.device)
            self._start = time.perf_counter()
        else:
            self.steps += 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        synchronize(pl_module.device)
        self.seconds = time.perf_counter() - self._start

    def per_step(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan


def with_synthetic_data(overrides: list[str], folder: Path):
    """The config of ``overrides`` with the synthetic data its task writes into ``folder``."""
    cfg = compose(overrides)
    write = get_task(cfg.task.name).synthetic_data
    if write is None:
        raise RuntimeError(f"task {cfg.task.name!r} writes no synthetic data")
    return compose([*overrides, *write(cfg, folder)])


def median_ms(fn: Callable[[], None], device: torch.device, calls: tuple[int, int]) -> float:
    """Median wall time of ``fn`` in ms over ``calls[0]`` calls after ``calls[1]`` warm-up
    calls, the device synchronized around each."""
    timed, warmup = calls
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(timed):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def language_shapes(experiment: str, quick: bool) -> dict:
    """Sequence length, global batch, micro-batch and vocabulary of a language recipe (from
    its config), or of the miniature that ``--quick`` runs instead."""
    task = compose([f"experiment={experiment}"]).task
    model = {"experiment": experiment, "arch": task.model.arch, "quick": quick}
    if quick:
        return {**model, "size": "tiny", "seq_len": 64, "batch_size": 8, "micro_batch_size": 4,
                "vocab_size": 512}
    data = task.data
    if data.tokenizer not in TOKENIZER_VOCAB:
        raise ValueError(f"{experiment}: task.data.tokenizer={data.tokenizer!r} has no synthetic "
                         f"vocabulary; known: {', '.join(TOKENIZER_VOCAB)}")
    return {**model, "size": task.model.size, "seq_len": data.seq_len,
            "batch_size": data.batch_size, "micro_batch_size": data.micro_batch_size,
            "vocab_size": TOKENIZER_VOCAB[data.tokenizer]}


def language_overrides(shapes: dict, steps: int, run_dir: Path, quick: bool) -> list[str]:
    """The recipe at ``shapes``, validated on one micro-batch."""
    seq, micro = shapes["seq_len"], shapes["micro_batch_size"]
    out = [f"experiment={shapes['experiment']}", f"task.model.size={shapes['size']}",
           f"task.data.vocab_size={shapes['vocab_size']}", f"task.data.seq_len={seq}",
           f"task.data.batch_size={shapes['batch_size']}", f"task.data.micro_batch_size={micro}",
           f"task.data.val_tokens={seq * micro}", f"trainer.max_steps={steps}",
           "schedule.warmup_steps=0", f"run.dir={run_dir}"]
    if quick:
        out.append("task.data.num_workers=0")
    return out


def finite(metrics: dict, key: str) -> float:
    value = metrics.get(key)
    if value is None or not math.isfinite(value):
        raise RuntimeError(f"{key} is {value}: training diverged or did not validate")
    return value


# ----------------------------------------------------------------------------- parts
def part_tests(check: Check) -> dict:
    """``pytest -m gpu`` over the test suite of this checkout, counted from its JUnit report."""
    tests = CHECKOUT / "tests"
    if not tests.is_dir():
        return {"status": "skipped", "reason": f"no test suite at {tests} (a source checkout "
                "installed with pip install -e has one)"}
    report = check.work / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               f"--junitxml={report}", str(tests)]
    code = subprocess.run(command, cwd=CHECKOUT).returncode
    if not report.is_file():
        raise RuntimeError(f"pytest exited with {code} and wrote no report")
    suites = ET.parse(report).getroot()
    cases = list(suites.iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    counts = {"passed": len(cases) - len(failed) - len(skipped), "failed": len(failed),
              "skipped": len(skipped)}
    result = {**counts, "failed_tests": failed, "exit_code": code,
              "command": f"pytest -q -m gpu {tests}"}
    if failed or code not in (0, 5):
        return {"status": "failed", "error": f"{len(failed)} of {len(cases)} gpu tests failed "
                f"(pytest exit {code})", **result}
    if not counts["passed"]:
        reasons = sorted({c.find("skipped").get("message", "") for c in skipped})
        return {"status": "skipped", "reason": "; ".join(reasons) or "no gpu tests", **result}
    return {"status": "ok", **result}


def run_bench(check: Check, flags: list[str]) -> dict:
    """``muoneq bench`` on the device with ``flags`` (quick: one set, one repeat)."""
    out = check.work / "bench.json"
    flags = ["--device", check.device.type, *flags]
    flags += ["--quick", "--sets", "gpt2_small", "--repeats", "1"] if check.quick else []
    if bench_main([*flags, "--out", str(out)]) != 0:
        raise RuntimeError("muoneq bench failed")
    return {"status": "ok", "command": "muoneq bench " + " ".join(flags),
            "result": json.loads(out.read_text())}


def part_bench(check: Check) -> dict:
    """``muoneq bench`` on the device, this project's rows and torch.optim.Muon's (``--compile``
    unless quick), and what ``ns_backend="auto"`` chose per shape, and why
    (:func:`auto_choices`)."""
    bench = run_bench(check, ["--peers", "without", *([] if check.quick else ["--compile"])])
    return {**bench, "auto": auto_choices(bench["result"], check)}


#: the sets the peers are timed on (their compilation per shape costs device time: ResNet-18's
#: ten filter shapes are left out)
PEER_SETS = ("gpt2_small", "llama2_130m", "gpt2_block")


def part_peers(check: Check) -> dict:
    """The public Muon implementations installed here (``muoneq bench --peers only``: beside
    torch.optim.Muon, our Muon and MuonEq-R, in one process) on :data:`PEER_SETS`."""
    sets = [] if check.quick else ["--sets", ",".join(PEER_SETS)]
    return run_bench(check, ["--peers", "only", *sets])


#: the bench row whose Newton–Schulz backend ``ns_backend="auto"`` chose per shape
AUTO_ROW = "MuonEq-R (auto)"


def auto_choices(bench: dict, check: Check) -> dict:
    """What ``ns_backend="auto"`` chose for each matrix shape of every bench set (the
    :data:`AUTO_ROW` row's backends, chosen by the optimizer's own timing at its first step),
    and why: both backends' bf16 NS5 of a stack of the set's matrices of that shape, each
    backend's stacked iteration timed here as ``auto`` times it (:func:`backend_timings`), and
    their agreement (relative distance; ``auto`` keeps Triton only within
    :data:`muoneq.newton_schulz.AGREEMENT`). Off a GPU ``auto`` is torch without a timing."""
    if check.device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return {"reason": "auto is torch off a CUDA GPU with Triton (no timing)", "sets": {}}
    return {"reason": "the faster of torch and Triton per shape, Triton only where it agrees",
            "sets": backend_choices(bench, check)}


def backend_choices(bench: dict, check: Check) -> dict:
    """Per bench set and matrix shape, the :data:`AUTO_ROW` row's backend and
    :func:`backend_timings` of both."""
    choices = {}
    for name, data in bench["sets"].items():
        shapes = Counter(matrix_shape(torch.empty(s, device="meta"))
                         for s in MATRIX_SETS[name](bench["quick"]))
        chosen = data["contenders"][AUTO_ROW]["ns_backends"]
        choices[name] = {key: {"chose": backend, **backend_timings(
            tuple(map(int, key.split("x"))), shapes, check)} for key, backend in chosen.items()}
    return choices


def backend_timings(shape: tuple[int, int], counts: Counter, check: Check) -> dict:
    """bf16 NS5 of a stack of ``counts[shape]`` random matrices of ``shape`` on each backend's
    stacked iteration, timed as ``ns_backend="auto"`` times them
    (:func:`muoneq.newton_schulz.time_iterations`: the stack and the buffers allocated before
    the clock starts, the device synchronized): ms and their relative distance."""
    X = torch.empty(max(1, counts[shape]), *shape, device=check.device, dtype=torch.bfloat16)
    candidates = auto_candidates()
    timed = time_iterations(candidates, X, (QUINTIC,) * 5, buffers_for(candidates["torch"], X))
    return {"matrices": len(X), **{f"{name}_ms": t["seconds"] * 1e3 for name, t in timed.items()},
            "distance": timed["triton"]["distance"]}


#: language part → (recipe, figure prefix, the model as the summary names it)
LANGUAGE_PARTS = {
    "gpt2": ("gpt2_small_fineweb", "gpt2_small", "GPT2-small"),
    "llama130m": ("llama130m_c4", "llama2_130m", "LLaMA2-130M"),
}


def part_language(check: Check, part: str) -> dict:
    """A language recipe's steps at its global batch, eager and compiled; MFU and the
    optimizer's share of a step."""
    experiment, _, _ = LANGUAGE_PARTS[part]
    shapes = language_shapes(experiment, check.quick)
    steps = 3 if check.quick else LANGUAGE_STEPS
    seq, batch = shapes["seq_len"], shapes["batch_size"]
    peak = mfu_peak(check)
    settings = {**shapes, "steps": steps, "timed_steps": steps - 1,
                "precision": check.precision, "tokens_per_step": seq * batch,
                "accumulation": batch // shapes["micro_batch_size"], "peak": peak}
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        if compiled and check.quick:
            runs[name] = {"status": "skipped", "reason": "--quick runs no torch.compile"}
            continue
        timer = OptimizerStepTimer()
        overrides = language_overrides(shapes, steps, check.work / f"{part}-{name}", check.quick)
        overrides += [*check.trainer_overrides(), f"trainer.compile={str(compiled).lower()}"]
        if not peak["datasheet"]:
            overrides.append(f"task.peak_tflops={peak['tflops']}")
        try:
            cfg = with_synthetic_data(overrides, check.work / f"{part}-tokens")
            metrics = train(cfg, callbacks=[timer])
        except Exception as err:  # the other variant still runs
            traceback.print_exc()
            runs[name] = failure(err)
            continue
        step_s, optimizer_s = metrics["step_time_median_s"], timer.median()
        runs[name] = {
            "status": "ok", "step_s": step_s, "tokens_per_s": metrics["tokens_per_s"],
            "mfu": metrics["mfu"],
            "achieved_tflops": metrics["flops_per_token"] * metrics["tokens_per_s"] / 1e12,
            "optimizer_step_ms": optimizer_s * 1e3,
            "optimizer_share": optimizer_s / step_s,
            "peak_memory_gb": metrics["peak_memory_gb"],
            "peak_memory_kind": metrics["peak_memory_kind"],
            "val_loss": finite(metrics, "val/loss"), "parameters": metrics["parameters"],
            "flops_per_token": metrics["flops_per_token"],
        }
    done = [k for k, r in runs.items() if r["status"] == "ok"]
    failed = [k for k, r in runs.items() if r["status"] == "failed"]
    result = {"status": "failed" if failed else "ok", "settings": settings, "runs": runs,
              "fastest": min(done, key=lambda k: runs[k]["step_s"]) if done else None}
    if failed:
        result["error"] = "; ".join(f"{k}: {runs[k]['error']}" for k in failed)
    return result


def step_breakdown(check: Check, cfg) -> dict:
    """Where a training step of the recipe ``cfg`` goes, on one batch of synthetic images and
    labels already on the device (bf16 autocast when the check trains in bf16, channels-last):
    forward and backward, ``optimizer.step()`` alone (on the same gradients) and the whole step
    (``zero_grad``, forward, backward, ``step``), medians; and the kernels of one optimizer step
    (on a CPU: its top-level operator calls)."""
    module, _ = get_task(cfg.task.name).build(cfg)
    model = module.model.to(check.device, memory_format=torch.channels_last)
    optimizer = build_optimizer_from_config(model, cfg.optimizer)
    batch = cfg.task.data.batch_size
    images = torch.randn(batch, 3, 32, 32, device=check.device)
    images = images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,), device=check.device)
    bf16 = check.precision.startswith("bf16")

    def forward_backward() -> None:
        with torch.autocast(check.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()

    def whole_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        forward_backward()
        optimizer.step()

    calls = QUICK_BREAKDOWN_CALLS if check.quick else BREAKDOWN_CALLS
    forward_backward()
    step_ms = median_ms(optimizer.step, check.device, calls)
    kernels, kind = operations(optimizer.step, check.device)
    optimizer.zero_grad(set_to_none=True)
    fb_ms = median_ms(lambda: (optimizer.zero_grad(set_to_none=True), forward_backward()),
                      check.device, calls)
    whole_ms = median_ms(whole_step, check.device, calls)
    return {"forward_backward_ms": fb_ms, "optimizer_step_ms": step_ms, "step_ms": whole_ms,
            "optimizer_kernels": kernels, "kernels_kind": kind,
            "optimizer_share": step_ms / whole_ms, "optimizer": cfg.optimizer.name,
            "timed_calls": calls[0], "warmup_calls": calls[1]}


def part_resnet(check: Check) -> dict:
    """One timed epoch of the CIFAR-10 recipe with channels-last weights, then where a step of
    it goes (:func:`step_breakdown`) and the loop's overhead."""
    overrides = ["experiment=cifar10_resnet18", "trainer.max_epochs=1",
                 *check.trainer_overrides(), f"run.dir={check.work / 'resnet'}"]
    if check.quick:
        overrides += ["task.model.width=8", "task.data.train_subset=256"]
    cfg = with_synthetic_data(overrides, check.work / "cifar10")
    epoch = EpochTimer()
    metrics = train(cfg, callbacks=[ChannelsLast(), epoch])
    breakdown = step_breakdown(check, cfg)
    batch = cfg.task.data.batch_size
    with np.load(cfg.task.data.root) as images:
        n_train, n_test = len(images["y_train"]), len(images["y_test"])
    return {
        "status": "ok",
        "settings": {"train_images": n_train, "test_images": n_test, "batch_size": batch,
                     "precision": check.precision, "channels_last": True,
                     "width": cfg.task.model.width},
        "epoch_s": metrics["train_seconds"], "steps": metrics["global_step"],
        "step_ms": metrics["step_time_median_s"] * 1e3,
        "epoch_step_ms": epoch.per_step() * 1e3,
        "train_images_per_s": batch / metrics["step_time_s"],
        "peak_memory_gb": metrics["peak_memory_gb"],
        "peak_memory_kind": metrics["peak_memory_kind"],
        "test_acc": metrics.get("test/acc"),
        "breakdown": breakdown,
        "loop_overhead": epoch.per_step() * 1e3 / breakdown["step_ms"],
    }


def part_fsdp2(check: Check) -> dict:
    """LLaMA2-1B under FSDP2 on one device for 2 steps of one micro-batch (``out of memory``
    is a result: the model did not fit)."""
    shapes = language_shapes("llama1b_c4", check.quick)
    shapes["batch_size"] = shapes["micro_batch_size"]  # one micro-batch per step
    overrides = language_overrides(shapes, FSDP2_STEPS, check.work / "fsdp2", check.quick)
    overrides += check.trainer_overrides("fsdp2")
    settings = {**shapes, "steps": FSDP2_STEPS,
                "precision": check.precision, "strategy": "fsdp2 (1 device)"}
    try:
        metrics = train(with_synthetic_data(overrides, check.work / "llama-tokens"))
    except torch.OutOfMemoryError as err:
        return {"status": "skipped", "reason": f"did not fit: {one_line(err)}",
                "settings": settings}
    return {"status": "ok", "settings": settings, "parameters": metrics["parameters"],
            "step_s": metrics["step_time_median_s"],
            "peak_memory_gb": metrics["peak_memory_gb"],
            "peak_memory_kind": metrics["peak_memory_kind"],
            "val_loss": finite(metrics, "val/loss")}


PARTS: dict[str, Callable[[Check], dict]] = {
    "tests": part_tests, "bench": part_bench, "peers": part_peers,
    **{name: partial(part_language, part=name) for name in LANGUAGE_PARTS},
    "resnet": part_resnet, "fsdp2": part_fsdp2,
}


def failure(err: BaseException) -> dict:
    """A failed part or run: a one-line error and the traceback."""
    return {"status": "failed", "error": one_line(err), "traceback": traceback.format_exc()}


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}"


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class Figure:
    """One figure of the results: its key in the results file, what it is, and its target on
    one H100 or H200 (``bound``, None: none set; ``sense`` "max": met at value ≤ bound, "min":
    at value ≥ bound). ``unit``: "×" a ratio, "%" a share, "ms", "s", "" a count or a name."""

    key: str
    what: str
    bound: float | None = None
    sense: str = "max"
    unit: str = "×"

    def show(self, value) -> str:
        if value is None:
            return "not measured"
        if isinstance(value, str):
            return value
        if self.unit == "%":
            return f"{value * 100:.3g}%"
        if self.unit == "":
            return f"{value:,.0f}"
        return f"{sig3(value)} {self.unit}" if self.unit in ("ms", "s") else f"{value:.3g}×"

    def target(self) -> str:
        if self.bound is None:
            return "none set"
        return f"{'≤' if self.sense == 'max' else '≥'} {self.show(self.bound)}"

    def verdict(self, value) -> str:
        if self.bound is None or value is None or isinstance(value, str):
            return "—"
        if value <= self.bound if self.sense == "max" else value >= self.bound:
            return "met"
        by = abs(value / self.bound - 1) * 100
        return f"missed by {by:.0f}%" if by >= 1 else f"missed by {by:.1g}%"


#: bench set → (its name in the summary, the target of MuonEq-R's step over torch.optim.Muon's)
BENCH_SETS = {"gpt2_small": ("GPT-2-small set", 0.23), "llama2_130m": ("LLaMA2-130M set", 0.16),
              "gpt2_block": ("one GPT-2 block", 1.0), "resnet18": ("ResNet-18 set", 0.25)}

#: Every figure the summary's table shows, with the targets of the GPU-speed work: the
#: optimizer step at or below the fastest public Muon step measured on the same GPU, MuonEq-R
#: ≤ 1.03× plain Muon, the accuracy rule (≤ 1.5× torch's bf16 NS5 error), peak extra memory
#: ≤ 2× torch's, the optimizer ≤ 20 % of a ResNet-18 step and ≤ 1 % of a language step, the
#: training loop ≤ 1.10× the raw step, language MFU ≥ 50 % compiled.
FIGURES = (
    *(figure for key, (name, bound) in BENCH_SETS.items() for figure in (
        Figure(f"muoneq_r_over_torch_muon_{key}", f"MuonEq-R step over torch.optim.Muon's, "
               f"{name}", bound),
        Figure(f"muoneq_r_over_muon_{key}", f"MuonEq-R step over our plain Muon's, {name}", 1.03),
        Figure(f"muoneq_r_err_over_torch_{key}", f"MuonEq-R bf16 NS5 error over torch's (worst "
               f"input), {name}", 1.5))),
    Figure("muoneq_r_peak_extra_over_torch_gpt2_small", "MuonEq-R peak extra memory over "
           "torch.optim.Muon's, GPT-2-small set", 2.0),
    Figure("fastest_muoneq_r_variant_gpt2_small", "fastest MuonEq-R variant, GPT-2-small set",
           unit=""),
    Figure("fastest_muoneq_r_variant_over_torch_muon_gpt2_small", "its step over "
           "torch.optim.Muon's"),
    *(figure for key in PEER_SETS for name in [BENCH_SETS[key][0]] for figure in (
        Figure(f"fastest_peer_{key}", f"fastest PyPI Muon (muoneq[bench]), {name}", unit=""),
        Figure(f"fastest_peer_over_torch_muon_{key}", f"fastest PyPI Muon's step over "
               f"torch.optim.Muon's, {name}"),
        Figure(f"muoneq_r_over_fastest_peer_{key}", f"MuonEq-R step over the fastest PyPI "
               f"Muon's, {name}"))),
    *(figure for _, key, name in LANGUAGE_PARTS.values() for figure in (
        Figure(f"{key}_mfu_compiled", f"{name} training MFU, compiled", 0.50, "min", "%"),
        Figure(f"{key}_mfu_eager", f"{name} training MFU, eager", unit="%"),
        Figure(f"{key}_optimizer_share", f"optimizer's share of a {name} step (faster run)",
               0.01, unit="%"),
        Figure(f"{key}_tokens_per_s", f"{name} tokens/s (faster run)", unit=""),
        Figure(f"{key}_run", f"{name}: the faster run", unit=""))),
    Figure("resnet18_forward_backward_ms", "ResNet-18 forward and backward, batch 128",
           unit="ms"),
    Figure("resnet18_optimizer_step_ms", "ResNet-18 optimizer.step()", unit="ms"),
    Figure("resnet18_optimizer_kernels", "kernels of one ResNet-18 optimizer.step() (CPU: "
           "top-level operator calls)", unit=""),
    Figure("resnet18_optimizer_share", "optimizer's share of a ResNet-18 training step", 0.20,
           unit="%"),
    Figure("resnet18_loop_overhead", "ResNet-18 training epoch's time per step over the whole "
           "step's", 1.10),
    Figure("resnet18_cifar10_epoch_s", "ResNet-18 CIFAR-10 epoch", unit="s"),
    Figure("llama1b_fsdp2", "LLaMA2-1B under FSDP2 on one device", unit=""),
)


def bench_figures(bench: dict) -> dict:
    figures = {}
    for key, data in bench["result"]["sets"].items():
        rows = data["contenders"]
        r = rows["MuonEq-R"]
        figures[f"muoneq_r_over_torch_muon_{key}"] = r["vs_torch"]
        figures[f"muoneq_r_over_muon_{key}"] = r["vs_muon"]
        figures[f"muoneq_r_err_over_torch_{key}"] = max(r["x_torch_gaussian"], r["x_torch_decay"])
        if key == "gpt2_small":
            torch_mb = rows["torch.optim.Muon"]["peak_extra_mb"]
            figures[f"muoneq_r_peak_extra_over_torch_{key}"] = (
                r["peak_extra_mb"] / torch_mb if torch_mb > 0 else None)
            variants = {k: v["vs_torch"] for k, v in rows.items() if k.startswith("MuonEq-R")}
            best = min(variants, key=variants.get)
            figures[f"fastest_muoneq_r_variant_{key}"] = best
            figures[f"fastest_muoneq_r_variant_over_torch_muon_{key}"] = variants[best]
    return figures


def peer_figures(part: dict) -> dict:
    """The fastest peer of each set (by its step over torch.optim.Muon's), and MuonEq-R's step
    over that peer's (median of per-repeat ratios: the rows were timed in the same repeats)."""
    figures = {}
    for key, data in part["result"]["sets"].items():
        rows = data["contenders"]
        peers = {name: rows[name] for name in part["result"]["peers"] if name in rows}
        if not peers:
            continue
        best = min(peers, key=lambda name: peers[name]["vs_torch"])
        figures[f"fastest_peer_{key}"] = best
        figures[f"fastest_peer_over_torch_muon_{key}"] = peers[best]["vs_torch"]
        figures[f"muoneq_r_over_fastest_peer_{key}"] = statistics.median(
            ours / theirs for ours, theirs in zip(rows["MuonEq-R"]["times_ms"],
                                                  peers[best]["times_ms"], strict=True))
    return figures


def language_figures(part: dict, key: str) -> dict:
    figures = {}
    for run in ("eager", "compiled"):
        if part["runs"].get(run, {}).get("status") == "ok":
            figures[f"{key}_mfu_{run}"] = part["runs"][run]["mfu"]
    if part.get("fastest"):
        run = part["runs"][part["fastest"]]
        figures[f"{key}_optimizer_share"] = run["optimizer_share"]
        figures[f"{key}_tokens_per_s"] = run["tokens_per_s"]
        figures[f"{key}_run"] = part["fastest"]
    return figures


def resnet_figures(part: dict) -> dict:
    if "breakdown" not in part:  # kept from a results file older than the breakdown
        return {"resnet18_cifar10_epoch_s": part["epoch_s"]}
    b = part["breakdown"]
    return {"resnet18_forward_backward_ms": b["forward_backward_ms"],
            "resnet18_optimizer_step_ms": b["optimizer_step_ms"],
            "resnet18_optimizer_kernels": b["optimizer_kernels"],
            "resnet18_optimizer_share": b["optimizer_share"],
            "resnet18_loop_overhead": part["loop_overhead"],
            "resnet18_cifar10_epoch_s": part["epoch_s"]}


def headline(parts: dict) -> dict:
    """Every figure of :data:`FIGURES`, from the parts that ran (None where a part did not)."""
    figures = dict.fromkeys(f.key for f in FIGURES)
    if parts.get("bench", {}).get("status") == "ok":
        figures.update(bench_figures(parts["bench"]))
    if parts.get("peers", {}).get("status") == "ok":
        figures.update(peer_figures(parts["peers"]))
    for name, (_, key, _) in LANGUAGE_PARTS.items():
        if "runs" in parts.get(name, {}):
            figures.update(language_figures(parts[name], key))
    if parts.get("resnet", {}).get("status") == "ok":
        figures.update(resnet_figures(parts["resnet"]))
    if "fsdp2" in parts:
        figures["llama1b_fsdp2"] = parts["fsdp2"]["status"]
    return figures


def target_rows(record: dict) -> list[tuple[str, str, str, str]]:
    """(what, target, measured, verdict) per figure of :data:`FIGURES`."""
    return [(f.what, f.target(), f.show(record.get(f.key)), f.verdict(record.get(f.key)))
            for f in FIGURES]


def section_tests(t: dict) -> list[str]:
    if "passed" not in t:
        return []
    return [f"`{t['command']}`: {t['passed']} passed, {t['failed']} failed, {t['skipped']} "
            "skipped.", *(f"- failed: `{name}`" for name in t["failed_tests"])]


def section_bench(b: dict) -> list[str]:
    if "result" not in b:
        return []
    return [f"`{b['command']}`", "", bench_table(b["result"]), *auto_lines(b.get("auto"))]


def auto_lines(auto: dict | None) -> list[str]:
    """``ns_backend="auto"``'s choice per shape, and the timings that explain it."""
    if auto is None:
        return []
    lines = ["", f"`ns_backend=\"auto\"`: {auto['reason']}."]
    rows = [(name, shape, c) for name, shapes in auto["sets"].items()
            for shape, c in shapes.items()]
    if rows:
        lines += ["", "| set | shape | matrices | chose | torch NS5 ms | Triton NS5 ms | "
                  "distance |", "|---|---|---:|---|---:|---:|---:|"]
        lines += [f"| {name} | {shape} | {c['matrices']} | {c['chose']} | "
                  f"{sig3(c['torch_ms'])} | {sig3(c['triton_ms'])} | {c['distance']:.1e} |"
                  for name, shape, c in rows]
    return lines


def section_language(g: dict) -> list[str]:
    if "runs" not in g:
        return []
    s, peak = g["settings"], g["settings"]["peak"]
    name = next(n for e, _, n in LANGUAGE_PARTS.values() if e == s["experiment"])
    measured = ("" if not peak["datasheet"] else f"; the {peak['measured_matmul']} ran at "
                f"{peak['measured_matmul_tflops']:.4g} TFLOP/s")
    miniature = f" (quick: a miniature, {s['arch']} {s['size']})" if s["quick"] else ""
    lines = [f"{name}, `{s['experiment']}`{miniature}: {s['seq_len']}-token sequences, "
             f"global batch {s['batch_size']} = {s['accumulation']} micro-batches of "
             f"{s['micro_batch_size']} ({s['tokens_per_step']:,} tokens per step), {s['precision']}"
             f", synthetic tokens (vocabulary {s['vocab_size']:,}); {s['steps']} steps, medians "
             f"over the last {s['timed_steps']}. MFU is against {peak['tflops']:.4g} TFLOP/s, "
             f"{peak['source']}{measured}. Optimizer: `optimizer.step()` without the closure "
             "Lightning runs inside it.", "",
             "| run | step s | tokens/s | MFU | achieved TFLOP/s | optimizer ms | "
             "optimizer share | peak memory GB | val loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run, r in g["runs"].items():
        if r["status"] != "ok":
            lines.append(f"| {run} | {r['status']}: {r.get('error') or r.get('reason')} "
                         "| | | | | | | |")
            continue
        mfu = "—" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {run} | {r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['achieved_tflops']:.3g} | {sig3(r['optimizer_step_ms'])} | "
                     f"{r['optimizer_share']:.2%} | {r['peak_memory_gb']:.3g} | "
                     f"{r['val_loss']:.3f} |")
    return lines


def section_resnet(r: dict) -> list[str]:
    if r["status"] != "ok":
        return []
    s = r["settings"]
    epoch = [f"{s['train_images']:,} synthetic training images, batch {s['batch_size']}, "
             f"{s['precision']}, channels-last, width {s['width']}: epoch {r['epoch_s']:.3g} s "
             f"(training, then the test pass over {s['test_images']:,} images), "
             f"{r['steps']} steps, median step {sig3(r['step_ms'])} ms, "
             f"{r['train_images_per_s']:,.0f} training images/s, peak memory "
             f"{r['peak_memory_gb']:.3g} GB."]
    if "breakdown" not in r:  # kept from a results file older than the breakdown
        return epoch
    b = r["breakdown"]
    return [*epoch, "",
            f"Where a step goes ({b['optimizer']}, one batch already on the device, medians of "
            f"{b['timed_calls']} after {b['warmup_calls']} warm-up calls): forward and backward "
            f"{sig3(b['forward_backward_ms'])} ms, `optimizer.step()` "
            f"{sig3(b['optimizer_step_ms'])} ms with {b['optimizer_kernels']:,} "
            f"{b['kernels_kind']}, the whole step {sig3(b['step_ms'])} ms: the optimizer is "
            f"{b['optimizer_share']:.0%} of it. The epoch ran at {sig3(r['epoch_step_ms'])} ms a "
            f"step (its first step left out), {r['loop_overhead']:.2f}× the whole step: the "
            "training loop's overhead."]


def section_fsdp2(f: dict) -> list[str]:
    if f["status"] != "ok":
        return []
    s = f["settings"]
    return [f"LLaMA2-{s['size']} ({f['parameters'] / 1e6:,.1f}M parameters), {s['strategy']}, "
            f"{s['steps']} steps of {s['batch_size']}×{s['seq_len']} tokens, {s['precision']}: "
            f"step {f['step_s']:.3g} s (the second), peak memory {f['peak_memory_gb']:.3g} GB, "
            f"val loss {f['val_loss']:.3f}."]


#: part → (heading, its section of the summary)
SECTIONS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "tests": ("1. GPU tests", section_tests),
    "bench": ("2. Optimizer step benchmark", section_bench),
    "peers": ("3. The public Muon implementations (muoneq[bench]) on the same matrices",
              section_bench),
    "gpt2": ("4. GPT2-small training", section_language),
    "llama130m": ("5. LLaMA2-130M training", section_language),
    "resnet": ("6. ResNet-18 / CIFAR-10: one epoch, and where a step goes", section_resnet),
    "fsdp2": ("7. LLaMA2-1B under FSDP2", section_fsdp2),
}


def summary(record: dict) -> str:
    """The Markdown summary of a results record."""
    parts = record["parts"]
    lines = [f"# gpu-check on {record['device_label']}", ""]
    if record["quick"]:
        lines += ["**QUICK RUN: miniature shapes, no torch.compile. Every figure below is a smoke "
                  "value (it shows that the path runs), not a measurement.**", ""]
    commit = code_version.short_commit(record["git_commit"], record["git_dirty"])
    lines += [f"{record['date']}, muoneq {record['muoneq_version']} at {commit}, torch "
              f"{record['torch']}, `{record['command']}`.", "",
              "| part | status | seconds | date | commit |", "|---|---|---:|---|---|"]
    for name in PARTS:
        if name not in parts:
            lines.append(f"| {name} | not run | | | |")
            continue
        p = parts[name]
        note = p.get("error") or p.get("reason")
        lines.append(f"| {name} | {p['status']}{': ' + note if note else ''} | "
                     f"{p['seconds']:.0f} | {p['date']} | {(p['git_commit'] or '?')[:10]} |")
    lines += ["", "## Figures and targets", "",
              "The targets are for one H100 or H200 (bf16); \"none set\": a figure reported for "
              "diagnosis."]
    rows = target_rows(record)
    if record["device_type"] != "cuda":
        lines.append("A CPU run is not compared with them.")
        rows = [(what, target, measured, "—") for what, target, measured, _ in rows]
    lines += ["", "| what | target | measured | verdict |", "|---|---|---|---|",
              *(f"| {' | '.join(row)} |" for row in rows)]
    for name, (heading, section) in SECTIONS.items():
        if name in parts and (body := section(parts[name])):
            lines += ["", f"## {heading}", "", *body]
    if record["device_type"] == "cpu":
        lines += ["", "Peak memory on a CPU is the process's peak resident set size."]
    return "\n".join(lines) + "\n"


def write_results(path: Path, record: dict, copy_to: Path | None) -> None:
    record.update(headline(record["parts"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2, default=str) + "\n")
    atomic_write(path.with_suffix(".md"), summary(record))
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for f in (path, path.with_suffix(".md")):
            shutil.copyfile(f, copy_to / f.name)


def earlier_parts(path: Path, device: str, quick: bool, running: list[str]) -> dict:
    """Parts of an earlier results file of the same device and mode that this run does not
    repeat."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    if earlier.get("device") != device or earlier.get("quick") != quick:
        return {}
    return {k: v for k, v in earlier.get("parts", {}).items() if k in PARTS and k not in running}


# ----------------------------------------------------------------------------- running parts
def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def run_part(part: str, check: Check) -> dict:
    """Run one part in this process: its result, or its failure (recorded; the next part runs)."""
    started = time.perf_counter()
    try:
        result = PARTS[part](check)
    except Exception as err:  # recorded; the remaining parts still run
        traceback.print_exc()
        result = failure(err)
    result["seconds"] = time.perf_counter() - started
    shutil.rmtree(check.work, ignore_errors=True)
    gc.collect()
    if check.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


#: Each part's limit in seconds on a full run, each part in a process of its own
#: (``--part-timeout auto``), 580 s in all, so that the whole check fits 10 minutes of a lent
#: GPU: 1.3–10× what the parts took on one H200 at commit 43ad865 (tests 18 s, bench 33 s,
#: GPT-2 48 s, ResNet 10 s, FSDP2 41 s), whose tests (Triton kernels compiled per shape,
#: ``compile=True``, two warm trials) and bench rows have grown since; the LLaMA part as
#: GPT-2's, the peers (compiled per shape by heavyball) as the bench.
PART_LIMITS = {"tests": 180, "bench": 90, "peers": 90, "gpt2": 70, "llama130m": 70,
               "resnet": 25, "fsdp2": 55}


def part_limits(setting: str, quick: bool) -> dict[str, float] | None:
    """The limit of every part (``--part-timeout``), or None: every part in this process."""
    if setting == "none" or (setting == "auto" and quick):
        return None
    if setting == "auto":
        return dict(PART_LIMITS)
    return dict.fromkeys(PARTS, float(setting))


def part_command(part: str, device: torch.device, quick: bool, out: Path) -> list[str]:
    """The command that runs ``part`` alone in a process of its own (``--part-timeout``): it
    records the part in the results file at ``out``."""
    return [sys.executable, "-m", "muoneq", "gpu-check", "--device", device.type,
            *(["--quick"] if quick else []), "--parts", part, "--part-timeout", "none",
            "--out", str(out)]


def run_part_in_process(part: str, device: torch.device, quick: bool, path: Path,
                        timeout: float) -> dict:
    """Run one part as :func:`part_command`, stopped with everything it started (its process
    group) after ``timeout`` seconds; the part's record from the results file it wrote, or one
    saying that it timed out or died."""
    started = time.perf_counter()
    process = subprocess.Popen(part_command(part, device, quick, path.parent),
                               start_new_session=True)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if process.poll() is None:  # timed out, or this process was interrupted
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.perf_counter() - started
    if code is None:
        return {"status": "timed out", "reason": f"stopped at its limit of {timeout:g} s "
                "(--part-timeout)", "seconds": seconds}
    written = json.loads(path.read_text())["parts"].get(part, {}) if path.is_file() else {}
    if written.get("status") in (None, "started"):
        return {"status": "failed", "error": f"its process exited with status {code} before "
                "recording the part", "seconds": seconds}
    return written


def run_parts(parts: list[str], record: dict, path: Path, copy_to: Path | None,
              device: torch.device, quick: bool, limits: dict[str, float] | None) -> None:
    """Run ``parts`` in order, here (``limits`` None) or each in a process of its own stopped
    at its limit, writing the results after every part (a part cut short by a kill stays
    ``started``)."""
    with tempfile.TemporaryDirectory(prefix="muoneq-gpu-check-") as scratch:
        for part in parts:
            print(f"\n[gpu-check] part {part} …", flush=True)
            stamp = {"date": now(), "git_commit": record["git_commit"]}
            record["parts"][part] = {"status": "started", "reason": "did not finish (the "
                                     "process was killed or crashed)", "seconds": 0.0, **stamp}
            write_results(path, record, copy_to)
            if limits is None:
                check = Check(device, quick, Path(scratch) / part)
                check.work.mkdir()
                result = run_part(part, check)
            else:
                result = run_part_in_process(part, device, quick, path, limits[part])
            record["parts"][part] = {**result, **stamp}
            write_results(path, record, copy_to)
            note = result.get("error") or result.get("reason") or ""
            print(f"[gpu-check] part {part}: {result['status']}{' — ' + note if note else ''} "
                  f"({result['seconds']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- command line
def parse(argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, list[str]]:
    parser = argparse.ArgumentParser(
        prog="muoneq gpu-check", description="Check every GPU path and record what it measured: "
        f"{', '.join(PARTS)} (docs/performance.md, 'GPU check').")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    parser.add_argument("--quick", action="store_true",
                        help="miniature shapes, no torch.compile: smoke values (CPU: required)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--part-timeout", default="auto", metavar="SECONDS",
                        help="run every part in a process of its own, stopped after SECONDS: "
                        "recorded as timed out, and the next part runs; auto (the default): "
                        "each part's own limit on a full run (PART_LIMITS), none with --quick; "
                        "none: every part in this process, no limit")
    parser.add_argument("--out", default=str(RESULTS_DIR),
                        help=f"folder of the results file (default {RESULTS_DIR})")
    parser.add_argument("--copy-to", default=None,
                        help="also copy the results there after every part (a machine's $OUT)")
    args = parser.parse_args(argv)
    if args.device not in ("auto", "cpu", "cuda"):
        parser.error(f"--device: expected auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.part_timeout not in ("auto", "none"):
        try:
            seconds = float(args.part_timeout)
        except ValueError:
            seconds = math.nan
        if not seconds > 0:
            parser.error(f"--part-timeout: expected seconds > 0, auto or none, got "
                         f"{args.part_timeout!r}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if device.type == "cpu" and not args.quick:
        parser.error("on a CPU only --quick runs (the recipes' shapes take hours there); add "
                     "--quick, or run on a GPU")
    return args, device, parts


def main(argv: list[str] | None = None) -> int:
    args, device, parts = parse(argv)
    path = results_path(Path(args.out), device, args.quick)
    name = device_name(device)
    copy_to = Path(args.copy_to) if args.copy_to else None
    base = session()
    record = {
        "device": name, "device_slug": device_slug(name), "device_type": device.type,
        "device_label": device_label(device), "quick": args.quick,
        "date": base["started"], "muoneq_version": base["muoneq_version"],
        "git_commit": base["git_commit"], "git_dirty": base["git_dirty"],
        "torch": base["torch"], "lightning": base["lightning"], "python": base["python"],
        "command": "muoneq gpu-check " + " ".join(sys.argv[1:] if argv is None else argv),
        "parts": earlier_parts(path, name, args.quick, parts),
    }
    print(f"[gpu-check] {record['device_label']}: parts {', '.join(parts)}"
          f"{' (quick: smoke values)' if args.quick else ''} -> {path}", flush=True)
    run_parts(parts, record, path, copy_to, device, args.quick,
              part_limits(args.part_timeout, args.quick))
    print("\n" + summary(record))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    failed = [p for p in parts if record["parts"][p]["status"] in ("failed", "timed out")]
    if failed:
        print(f"muoneq gpu-check: failed parts: {', '.join(failed)} (see above and {path})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
