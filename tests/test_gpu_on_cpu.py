"""What a GPU run records and what the GPU tests compare, checked on a CPU: the final figures
come from the device the run trained on (Lightning's teardown moves the module back to the CPU
before they are read), the commit a run names is its own checkout's or the one the user passed,
and the GPU tests' accuracy reference runs in the GPU's dtype."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muoneq.suite import code_version
from muoneq.suite.runtime import compose, train
from tests.helpers import gpu
from tests.helpers.gpu import GPU_NS_DTYPE, TrainsOnFakeCuda, ns5_errors
from tests.helpers.runtime import tiny_language

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture
def stub_cuda(monkeypatch):
    """torch.cuda's functions the runtime calls for a CUDA device (:func:`gpu.stub_cuda`)."""
    calls = []
    gpu.stub_cuda(monkeypatch, calls)
    return calls


def test_final_metrics_of_a_cuda_run_read_the_device_it_trained_on(tmp_path, stub_cuda):
    cfg = compose(["experiment=llama_tiny_shakespeare", *tiny_language(tmp_path),
                   "trainer.max_steps=3", "schedule.total_steps=3", f"run.dir={tmp_path / 'run'}"])
    metrics = train(cfg, callbacks=[TrainsOnFakeCuda()])
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["status"] == "finished" and "reset" in stub_cuda
    assert written["peak_memory_kind"] == "device_allocated"
    assert written["peak_memory_gb"] == 3.0
    # MFU against the H200's dense bf16 datasheet peak, 989.4 TFLOP/s
    assert written["mfu"] == pytest.approx(
        written["flops_per_token"] * written["tokens_per_s"] / 989.4e12)
    assert metrics["mfu"] == written["mfu"] and written["mfu"] > 0


def provenance(package_root: Path, **env) -> dict:
    """The commit and dirty flag ``muoneq`` records when imported from ``package_root``."""
    code = ("import json; from muoneq.suite import code_version; "
            "version = code_version.taken(); print(json.dumps([version.commit, version.dirty]))")
    environment = {k: v for k, v in os.environ.items() if k != code_version.COMMIT_ENV}
    done = subprocess.run([sys.executable, "-c", code], cwd=package_root, text=True,
                          capture_output=True, timeout=300,
                          env={**environment, "PYTHONPATH": str(package_root), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    commit, dirty = json.loads(done.stdout.strip().splitlines()[-1])
    return {"commit": commit, "dirty": dirty}


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_the_commit_is_the_checkouts_own_or_the_one_passed(tmp_path):
    """A copy of the checkout inside another git repository (a lent machine's working tree)
    names no commit of that repository; MUONEQ_GIT_COMMIT, when given, wins."""
    outer = tmp_path / "outer"
    copy = outer / "work" / "muoneq-copy"
    shutil.copytree(ROOT / "muoneq", copy / "muoneq",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git(outer, "init", "-q")
    git(outer, "add", "-A")
    git(outer, "commit", "-qm", "another project")
    assert provenance(copy) == {"commit": None, "dirty": None}
    given = "43ad865" + "0" * 33
    assert provenance(copy, **{code_version.COMMIT_ENV: given}) == {"commit": given, "dirty": None}

    # a checkout of its own: its HEAD, and whether its tracked files changed
    git(copy, "init", "-q")
    git(copy, "add", "-A")
    git(copy, "commit", "-qm", "the checkout")
    head = git(copy, "rev-parse", "HEAD")
    assert provenance(copy) == {"commit": head, "dirty": False}
    with (copy / "muoneq" / "suite" / "folders.py").open("a") as tracked:
        tracked.write("# changed\n")
    assert provenance(copy) == {"commit": head, "dirty": True}
    assert provenance(copy, **{code_version.COMMIT_ENV: given}) == {"commit": given, "dirty": None}


def test_the_gpu_tests_accuracy_reference_runs_in_the_gpus_dtype():
    """The comparison of ``test_gpu.py``'s bf16 accuracy test, with the CPU standing in for the
    GPU: the reference is the same computation (same dtype) as the device's standard order, so
    the test compares like with like, and the Gram order is within its 1.5× there too."""
    errors = ns5_errors("cpu")
    assert GPU_NS_DTYPE == torch.bfloat16
    assert errors["cpu"] == errors["standard"]
    assert 1e-3 < errors["cpu"] < 5e-2  # bf16's rounding, not float32's (~1e-5)
    assert errors["gram"] <= 1.5 * errors["cpu"]


def test_the_gpu_tests_language_data_needs_no_datasets(tmp_path, monkeypatch):
    """The shards ``test_gpu.py``'s language run trains on, made where ``datasets`` is missing
    (a GPU machine that reaches no registry has none)."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ModuleNotFoundError
    overrides = tiny_language(tmp_path)
    assert f"task.data.dir={tmp_path / 'shards'}" in overrides
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.bin"))[-1] == "data_val_000000.bin"


# ------------------------------------------------------------------ the Triton kernels' checks
#: the kernel checks of ``test_gpu.py``, run here by Triton's interpreter (``conftest.py`` turns
#: it on where there is no GPU; on a GPU machine ``test_gpu.py`` runs them compiled; the
#: accuracy rule's check runs here in ``test_ns_backends.py``)
interpreted = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="a GPU is here: test_gpu.py runs the compiled kernels")


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", gpu.KERNEL_STACKS, ids=str)
def test_a_newton_schulz_step_on_the_kernels_is_torchs_within_rounding(shape, dtype, kernels):
    assert gpu.triton_step_units(shape, dtype, "cpu") <= gpu.STEP_UNITS[dtype]


@pytest.mark.slow
def test_the_kernels_address_a_stack_past_2_31_elements():
    """Offsets past 2³¹ elements (a program's index times a stride) are 64-bit in the kernels:
    with 32-bit ones the third matrix of :func:`gpu.far_apart_stack_units` is read at a
    negative offset (in the interpreter, a segmentation fault; on a GPU, an illegal address).
    Run in a process of its own, with the interpreter, so that such a fault is reported."""
    code = ("from tests.helpers.gpu import far_apart_stack_distance\n"
            "from tests.helpers.triton_interpreter import corrected\n"
            "with corrected():\n    print(far_apart_stack_distance('cpu'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert float(done.stdout.strip().splitlines()[-1]) <= gpu.NS5_AGREEMENT
