"""What a GPU run records, checked on a CPU: the final figures come from the device the run
trained on (Lightning's teardown moves the module back to the CPU before they are read), and
the commit a run names is its own checkout's or the one the user passed."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from muoneq.suite.runtime import compose, train
from tests.helpers.runtime import tiny_language

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


class TrainsOnFakeCuda(L.Callback):
    """Makes the module say it is on ``cuda:0`` from fit start until training starts (when the
    runtime's callbacks, which run before this one, capture the device), then puts it back: the
    tensors stay on the CPU. After training, Lightning's teardown calls ``module.cpu()``, as it
    does on a GPU."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module._device = torch.device("cuda", 0)

    def on_train_start(self, trainer, pl_module) -> None:
        assert pl_module.device.type == "cuda"  # what the callbacks before this one saw
        pl_module._device = torch.device("cpu")


@pytest.fixture
def stub_cuda(monkeypatch):
    """torch.cuda's functions the runtime calls for a CUDA device, as on one H200 that used
    3 GiB at its peak."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3.0 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    return calls


def test_final_metrics_of_a_cuda_run_read_the_device_it_trained_on(tmp_path, stub_cuda):
    cfg = compose(["experiment=llama_tiny_shakespeare", *tiny_language(tmp_path),
                   "trainer.max_steps=3", "schedule.total_steps=3", f"run.dir={tmp_path / 'run'}"])
    metrics = train(cfg, callbacks=[TrainsOnFakeCuda()])
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["status"] == "finished" and "reset" in stub_cuda and "sync" in stub_cuda
    assert written["peak_memory_kind"] == "device_allocated"
    assert written["peak_memory_gb"] == 3.0
    # MFU against the H200's dense bf16 datasheet peak, 989.4 TFLOP/s
    assert written["mfu"] == pytest.approx(
        written["flops_per_token"] * written["tokens_per_s"] / 989.4e12)
    assert metrics["mfu"] == written["mfu"] and written["mfu"] > 0
