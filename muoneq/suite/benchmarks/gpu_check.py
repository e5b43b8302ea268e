"""Check every GPU path in one command and record what it measured: ``muoneq gpu-check``
(``make gpu-check``).

Five parts, run in this order; a part that fails is recorded and the next one still runs, and
the results are written again after every part (a kill loses no finished part):

1. ``tests``: ``pytest -m gpu tests`` (the CUDA checks; they skip without a GPU);
2. ``bench``: ``muoneq bench --compile`` on the device: the three matrix sets, every contender
   (``torch.optim.Muon``, our Muon, MuonEq R/C/RC, the Gram order, the other batching path,
   ``compile=True``) and the accuracy rule;
3. ``gpt2``: GPT2-small at the recipe's shapes (``conf/experiment/gpt2_small_fineweb.yaml``:
   4,096-token sequences, global batch 128 = 16 micro-batches of 8) trained for a few steps on
   synthetic tokens, eager and with ``trainer.compile=true``: tokens/s, MFU, and the
   optimizer's share of a step (``optimizer.step()`` timed inside training at the recipe's
   global batch);
4. ``resnet``: one epoch of the CIFAR-10 recipe (ResNet-18, batch 128) with channels-last
   weights on synthetic CIFAR-shaped images (50,000 training, 10,000 test), timed;
5. ``fsdp2``: LLaMA2-1B built and trained for 2 steps under FSDP2 on one device, one
   micro-batch per step (a build check: sharding, the sharded optimizer step, the distributed
   checkpoint); out of memory is recorded as "did not fit".

Training parts go through :func:`muoneq.suite.runtime.train` with the recipes' configs, so they run
what ``muoneq train`` runs. On CUDA they train in ``bf16-mixed`` and MFU is against the
device's dense bf16 datasheet peak (``PEAK_TFLOPS`` of the language task) or, for a GPU not
listed there, against a bf16 matmul rate measured here. On a CPU they train in ``32-true``
(bf16 matmuls are an order of magnitude slower than float32 on many CPUs) and MFU is against a
float32 matmul rate measured here; the results say which.

``--quick`` shrinks every part to a miniature (tiny models, short sequences, the bench's
quick sets, no ``torch.compile``): its figures are smoke values, used by the test suite
(``make gpu-check DEVICE=cpu QUICK=1``). A CPU runs only ``--quick``: the recipes' shapes take
hours there.

Output: ``<out>/<device-slug>.json`` (``<device-slug>-quick.json`` with ``--quick``; a failed
part keeps its one-line error and traceback there, a part cut short by a kill stays
``started``) and a Markdown summary beside it. Parts not run this time (``--parts``) are kept
from an earlier file of the same name, each with its own date and commit, so a check split over
two machine sessions ends in one file. A copy of the checkout without ``.git`` (a lent machine)
takes its commit from ``$MUONEQ_GIT_COMMIT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from muoneq.suite.benchmarks.bench_step import device_label, sig3
from muoneq.suite.benchmarks.bench_step import main as bench_main
from muoneq.suite.benchmarks.bench_step import table as bench_table
from muoneq.suite.files import atomic_write, slug
from muoneq.suite.folders import CHECKOUT
from muoneq.suite.machine import device_name
from muoneq.suite.runtime import compose, train
from muoneq.suite.runtime.accelerators import synchronize
from muoneq.suite.runtime.record import session
from muoneq_tasks.language.module import device_peak_tflops
from muoneq_tasks.language.shards import shard_name, write_shard

RESULTS_DIR = Path("benchmarks/results")

#: Vocabulary of the recipes' tokenizers (synthetic tokens are drawn below it; no tokenizer
#: file is needed, so the check runs offline).
TOKENIZER_VOCAB = {"gpt2": 50257, "hf:google-t5/t5-base": 32100}

#: Optimizer steps of the training parts (the first is warm-up: StepStats does not time it).
GPT2_STEPS, FSDP2_STEPS = 4, 2


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
        """One device of this check's kind, quiet, in this check's precision."""
        trainer = ["trainer=fsdp2"] if strategy == "fsdp2" else ["trainer.strategy=single"]
        return [*trainer, f"trainer.accelerator={self.device.type}", "trainer.devices=1",
                f"trainer.precision={self.precision}", "trainer.progress=quiet"]


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


def write_token_shards(folder: Path, vocab: int, train_tokens: int, val_tokens: int) -> Path:
    """Uniform random token ids in the shard format of the language task."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(folder / shard_name("synthetic", "train", 1), rng.integers(0, vocab, train_tokens))
    write_shard(folder / shard_name("synthetic", "val", 0), rng.integers(0, vocab, val_tokens))
    return folder


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


def language_overrides(shapes: dict, steps: int, data_dir: Path, run_dir: Path,
                       quick: bool) -> list[str]:
    """The recipe at ``shapes`` on synthetic shards, validated on one micro-batch."""
    seq, micro = shapes["seq_len"], shapes["micro_batch_size"]
    out = [f"experiment={shapes['experiment']}", f"task.model.size={shapes['size']}",
           f"task.data.dir={data_dir}",
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


def part_bench(check: Check) -> dict:
    """``muoneq bench`` on the device (``--compile`` unless quick; quick: one set, one repeat)."""
    out = check.work / "bench.json"
    flags = ["--device", check.device.type]
    flags += ["--quick", "--sets", "gpt2_small", "--repeats", "1"] if check.quick else ["--compile"]
    if bench_main([*flags, "--out", str(out)]) != 0:
        raise RuntimeError("muoneq bench failed")
    return {"status": "ok", "command": "muoneq bench " + " ".join(flags),
            "result": json.loads(out.read_text())}


def part_gpt2(check: Check) -> dict:
    """GPT2-small steps at the recipe's global batch, eager and compiled; MFU and the
    optimizer's share of a step."""
    shapes = language_shapes("gpt2_small_fineweb", check.quick)
    steps = 3 if check.quick else GPT2_STEPS
    seq, batch = shapes["seq_len"], shapes["batch_size"]
    data = write_token_shards(check.work / "gpt2-tokens", shapes["vocab_size"],
                              ((steps + 1) * batch + 1) * seq + 1,
                              seq * shapes["micro_batch_size"] + 1)
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
        overrides = language_overrides(shapes, steps, data, check.work / f"gpt2-{name}",
                                       check.quick)
        overrides += [*check.trainer_overrides(), f"trainer.compile={str(compiled).lower()}"]
        if not peak["datasheet"]:
            overrides.append(f"task.peak_tflops={peak['tflops']}")
        try:
            metrics = train(compose(overrides), callbacks=[timer])
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


def write_cifar_npz(path: Path, n_train: int, n_test: int) -> Path:
    """Random uint8 images and labels with CIFAR-10's shapes, in the task's ``.npz`` format."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        arrays[f"x_{split}"] = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, 10, n, dtype=np.int64)
    np.savez(path, **arrays)
    return path


def part_resnet(check: Check) -> dict:
    """One timed epoch of the CIFAR-10 recipe with channels-last weights."""
    n_train, n_test = (256, 64) if check.quick else (50_000, 10_000)
    npz = write_cifar_npz(check.work / "cifar10.npz", n_train, n_test)
    overrides = ["experiment=cifar10_resnet18", f"task.data.root={npz}", "trainer.max_epochs=1",
                 *check.trainer_overrides(), f"run.dir={check.work / 'resnet'}"]
    if check.quick:
        overrides.append("task.model.width=8")
    cfg = compose(overrides)
    metrics = train(cfg, callbacks=[ChannelsLast()])
    batch = cfg.task.data.batch_size
    return {
        "status": "ok",
        "settings": {"train_images": n_train, "test_images": n_test, "batch_size": batch,
                     "precision": check.precision, "channels_last": True,
                     "width": cfg.task.model.width},
        "epoch_s": metrics["train_seconds"], "steps": metrics["global_step"],
        "step_ms": metrics["step_time_median_s"] * 1e3,
        "train_images_per_s": batch / metrics["step_time_s"],
        "peak_memory_gb": metrics["peak_memory_gb"],
        "peak_memory_kind": metrics["peak_memory_kind"],
        "test_acc": metrics.get("test/acc"),
    }


def part_fsdp2(check: Check) -> dict:
    """LLaMA2-1B under FSDP2 on one device for 2 steps of one micro-batch (``out of memory``
    is a result: the model did not fit)."""
    shapes = language_shapes("llama1b_c4", check.quick)
    shapes["batch_size"] = shapes["micro_batch_size"]  # one micro-batch per step
    seq, batch = shapes["seq_len"], shapes["batch_size"]
    data = write_token_shards(check.work / "llama-tokens", shapes["vocab_size"],
                              ((FSDP2_STEPS + 1) * batch + 1) * seq + 1, seq * batch + 1)
    overrides = language_overrides(shapes, FSDP2_STEPS, data, check.work / "fsdp2", check.quick)
    overrides += check.trainer_overrides("fsdp2")
    settings = {**shapes, "steps": FSDP2_STEPS,
                "precision": check.precision, "strategy": "fsdp2 (1 device)"}
    try:
        metrics = train(compose(overrides))
    except torch.OutOfMemoryError as err:
        return {"status": "skipped", "reason": f"did not fit: {one_line(err)}",
                "settings": settings}
    return {"status": "ok", "settings": settings, "parameters": metrics["parameters"],
            "step_s": metrics["step_time_median_s"],
            "peak_memory_gb": metrics["peak_memory_gb"],
            "peak_memory_kind": metrics["peak_memory_kind"],
            "val_loss": finite(metrics, "val/loss")}


PARTS: dict[str, Callable[[Check], dict]] = {
    "tests": part_tests, "bench": part_bench, "gpt2": part_gpt2, "resnet": part_resnet,
    "fsdp2": part_fsdp2,
}


def failure(err: BaseException) -> dict:
    """A failed part or run: a one-line error and the traceback."""
    return {"status": "failed", "error": one_line(err), "traceback": traceback.format_exc()}


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}"


# ----------------------------------------------------------------------------- results
#: The targets of issue 16 on an H100/H200 (GPT2-small matrix set, bf16): (key, what, bound,
#: "max" (value ≤ bound) or "min" (value ≥ bound)).
TARGETS = (
    ("muoneq_r_over_torch_muon_gpt2_small", "MuonEq-R step over torch.optim.Muon's", 0.5, "max"),
    ("muoneq_r_over_muon_gpt2_small", "MuonEq-R step over our Muon's", 1.03, "max"),
    ("muoneq_r_err_over_torch_gpt2_small", "MuonEq-R bf16 NS5 error over torch's (worst)",
     1.5, "max"),
    ("gpt2_small_mfu", "GPT2-small training MFU", 0.40, "min"),
    ("gpt2_small_optimizer_share", "optimizer share of a GPT2-small step", 0.01, "max"),
)


#: Figures recorded beside the targets' (None where their part did not run).
FIGURES = ("fastest_muoneq_r_variant_gpt2_small",
           "fastest_muoneq_r_variant_over_torch_muon_gpt2_small", "gpt2_small_tokens_per_s",
           "gpt2_small_run", "resnet18_cifar10_epoch_s", "llama1b_fsdp2")


def headline(parts: dict) -> dict:
    """The key figures, from the parts that ran (None where a part did not)."""
    figures = dict.fromkeys([*(key for key, *_ in TARGETS), *FIGURES])
    bench = parts.get("bench", {})
    if bench.get("status") == "ok" and "gpt2_small" in bench["result"]["sets"]:
        rows = bench["result"]["sets"]["gpt2_small"]["contenders"]
        r = rows["MuonEq-R"]
        figures["muoneq_r_over_torch_muon_gpt2_small"] = r["vs_torch"]
        figures["muoneq_r_over_muon_gpt2_small"] = r["vs_muon"]
        figures["muoneq_r_err_over_torch_gpt2_small"] = max(r["x_torch_gaussian"],
                                                           r["x_torch_decay"])
        variants = {k: v["vs_torch"] for k, v in rows.items() if k.startswith("MuonEq-R")}
        best = min(variants, key=variants.get)
        figures["fastest_muoneq_r_variant_gpt2_small"] = best
        figures["fastest_muoneq_r_variant_over_torch_muon_gpt2_small"] = variants[best]
    gpt2 = parts.get("gpt2", {})
    if gpt2.get("fastest"):
        run = gpt2["runs"][gpt2["fastest"]]
        figures["gpt2_small_mfu"] = run["mfu"]
        figures["gpt2_small_optimizer_share"] = run["optimizer_share"]
        figures["gpt2_small_tokens_per_s"] = run["tokens_per_s"]
        figures["gpt2_small_run"] = gpt2["fastest"]
    if parts.get("resnet", {}).get("status") == "ok":
        figures["resnet18_cifar10_epoch_s"] = parts["resnet"]["epoch_s"]
    if "fsdp2" in parts:
        figures["llama1b_fsdp2"] = parts["fsdp2"]["status"]
    return figures


def target_rows(record: dict) -> list[tuple[str, str, str, str]]:
    """(what, target, measured, verdict) per target of issue 16."""
    rows = []
    for key, what, bound, sense in TARGETS:
        value = record.get(key)
        target = f"{'≤' if sense == 'max' else '≥'} {bound:g}"
        if value is None:
            rows.append((what, target, "not measured", "—"))
            continue
        met = value <= bound if sense == "max" else value >= bound
        verdict = "met" if met else f"missed by {abs(value / bound - 1):.0%}"
        rows.append((what, target, f"{value:.3g}", verdict))
    return rows


def section_tests(t: dict) -> list[str]:
    if "passed" not in t:
        return []
    return [f"`{t['command']}`: {t['passed']} passed, {t['failed']} failed, {t['skipped']} "
            "skipped.", *(f"- failed: `{name}`" for name in t["failed_tests"])]


def section_bench(b: dict) -> list[str]:
    return [f"`{b['command']}`", "", bench_table(b["result"])] if "result" in b else []


def section_gpt2(g: dict) -> list[str]:
    if "runs" not in g:
        return []
    s, peak = g["settings"], g["settings"]["peak"]
    measured = ("" if not peak["datasheet"] else f"; the {peak['measured_matmul']} ran at "
                f"{peak['measured_matmul_tflops']:.4g} TFLOP/s")
    miniature = " (quick: a miniature)" if s["quick"] else ""
    lines = [f"GPT-2 {s['size']}, `{s['experiment']}`{miniature}: {s['seq_len']}-token sequences, "
             f"global batch {s['batch_size']} = {s['accumulation']} micro-batches of "
             f"{s['micro_batch_size']} ({s['tokens_per_step']:,} tokens per step), {s['precision']}"
             f", synthetic tokens (vocabulary {s['vocab_size']:,}); {s['steps']} steps, medians "
             f"over the last {s['timed_steps']}. MFU is against {peak['tflops']:.4g} TFLOP/s, "
             f"{peak['source']}{measured}. Optimizer: `optimizer.step()` without the closure "
             "Lightning runs inside it.", "",
             "| run | step s | tokens/s | MFU | achieved TFLOP/s | optimizer ms | "
             "optimizer share | peak memory GB | val loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in g["runs"].items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']}: {r.get('error') or r.get('reason')} "
                         "| | | | | | | |")
            continue
        mfu = "—" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {name} | {r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['achieved_tflops']:.3g} | {sig3(r['optimizer_step_ms'])} | "
                     f"{r['optimizer_share']:.2%} | {r['peak_memory_gb']:.3g} | "
                     f"{r['val_loss']:.3f} |")
    return lines


def section_resnet(r: dict) -> list[str]:
    if r["status"] != "ok":
        return []
    s = r["settings"]
    return [f"{s['train_images']:,} synthetic training images, batch {s['batch_size']}, "
            f"{s['precision']}, channels-last, width {s['width']}: epoch {r['epoch_s']:.3g} s "
            f"(training and its validation pass over {s['test_images']:,} test images), "
            f"{r['steps']} steps, median step {sig3(r['step_ms'])} ms, "
            f"{r['train_images_per_s']:,.0f} training images/s, peak memory "
            f"{r['peak_memory_gb']:.3g} GB."]


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
    "gpt2": ("3. GPT2-small training", section_gpt2),
    "resnet": ("4. ResNet-18 / CIFAR-10, one epoch", section_resnet),
    "fsdp2": ("5. LLaMA2-1B under FSDP2", section_fsdp2),
}


def summary(record: dict) -> str:
    """The Markdown summary of a results record."""
    parts = record["parts"]
    lines = [f"# gpu-check on {record['device_label']}", ""]
    if record["quick"]:
        lines += ["**QUICK RUN: miniature shapes, no torch.compile. Every figure below is a smoke "
                  "value (it shows that the path runs), not a measurement.**", ""]
    commit = (record["git_commit"] or "unknown")[:10] + (" (dirty)" if record["git_dirty"] else "")
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
    lines += ["", "## Targets (issue 16)", ""]
    if record["device_type"] != "cuda":
        lines.append("The targets are for an H100 or H200; a CPU run is not compared with them.")
    else:
        lines += ["| what | target | measured | verdict |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in target_rows(record)]
        if best := record.get("fastest_muoneq_r_variant_gpt2_small"):
            ratio = record["fastest_muoneq_r_variant_over_torch_muon_gpt2_small"]
            lines.append(f"\nFastest MuonEq-R variant: {best}, {ratio:.3f}× torch.optim.Muon.")
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


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="muoneq gpu-check", description="Check every GPU path and record what it measured: "
        f"{', '.join(PARTS)} (docs/performance.md, 'GPU check').")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    parser.add_argument("--quick", action="store_true",
                        help="miniature shapes, no torch.compile: smoke values (CPU: required)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--out", default=str(RESULTS_DIR),
                        help=f"folder of the results file (default {RESULTS_DIR})")
    parser.add_argument("--copy-to", default=None,
                        help="also copy the results there after every part (a machine's $OUT)")
    args = parser.parse_args(argv)
    if args.device not in ("auto", "cpu", "cuda"):
        parser.error(f"--device: expected auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if device.type == "cpu" and not args.quick:
        parser.error("on a CPU only --quick runs (the recipes' shapes take hours there); add "
                     "--quick, or run on a GPU")

    path = results_path(Path(args.out), device, args.quick)
    name = device_name(device)
    kept = earlier_parts(path, name, args.quick, parts)
    copy_to = Path(args.copy_to) if args.copy_to else None
    base = session()
    # a copy of the checkout without .git (a lent machine) names its commit in the environment
    base["git_commit"] = base["git_commit"] or os.environ.get("MUONEQ_GIT_COMMIT")
    record = {
        "device": name, "device_slug": device_slug(name), "device_type": device.type,
        "device_label": device_label(device), "quick": args.quick,
        "date": base["started"], "muoneq_version": base["muoneq_version"],
        "git_commit": base["git_commit"], "git_dirty": base["git_dirty"],
        "torch": base["torch"], "lightning": base["lightning"], "python": base["python"],
        "command": "muoneq gpu-check " + " ".join(sys.argv[1:] if argv is None else argv),
        "parts": kept,
    }
    print(f"[gpu-check] {record['device_label']}: parts {', '.join(parts)}"
          f"{' (quick: smoke values)' if args.quick else ''} -> {path}", flush=True)
    with tempfile.TemporaryDirectory(prefix="muoneq-gpu-check-") as scratch:
        for part in parts:
            print(f"\n[gpu-check] part {part} …", flush=True)
            check = Check(device, args.quick, Path(scratch) / part)
            check.work.mkdir()
            started = time.perf_counter()
            stamp = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                     "git_commit": base["git_commit"]}
            # what a kill or a crash of the process leaves in the file
            record["parts"][part] = {"status": "started", "reason": "did not finish (the "
                                     "process was killed or crashed)", "seconds": 0.0, **stamp}
            write_results(path, record, copy_to)
            try:
                result = PARTS[part](check)
            except Exception as err:  # recorded; the remaining parts still run
                traceback.print_exc()
                result = failure(err)
            result.update(seconds=time.perf_counter() - started, **stamp)
            record["parts"][part] = result
            shutil.rmtree(check.work, ignore_errors=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_results(path, record, copy_to)
            status = result["status"]
            note = result.get("error") or result.get("reason") or ""
            print(f"[gpu-check] part {part}: {status}{' — ' + note if note else ''} "
                  f"({result['seconds']:.0f} s)", flush=True)
    print("\n" + summary(record))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    failed = [p for p in parts if record["parts"][p]["status"] == "failed"]
    if failed:
        print(f"muoneq gpu-check: failed parts: {', '.join(failed)} (see above and {path})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
