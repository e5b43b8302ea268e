"""What the GPU tests compare, written so that a CPU test runs the same comparison with the CPU
standing in for the GPU."""

from __future__ import annotations

import time

import lightning as L
import torch

from muoneq import newton_schulz
from muoneq.newton_schulz import resolve_dtype

#: The dtype Newton–Schulz runs in on a GPU by default (``ns_dtype="auto"``).
GPU_NS_DTYPE = resolve_dtype("auto", "cuda")


def ns5_errors(device: str) -> dict[str, float]:
    """Relative Frobenius distance of NS5 to a float64 NS5 of one 256×1024 Gaussian matrix,
    all in :data:`GPU_NS_DTYPE`: on ``device`` for each evaluation order, and on the CPU in the
    standard order (``"cpu"``: the reference, like with like)."""
    G = torch.randn(256, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = newton_schulz(G, 5, dtype=torch.float64)

    def error(where: str, algorithm: str) -> float:
        X = newton_schulz(G.float().to(where), 5, dtype=GPU_NS_DTYPE, algorithm=algorithm)
        return ((X.double().cpu() - exact).norm() / exact.norm()).item()

    errors = {algorithm: error(device, algorithm) for algorithm in ("standard", "gram")}
    return {**errors, "cpu": error("cpu", "standard")}


class FakeEvent:
    """``torch.cuda.Event`` for a run that believes it is on CUDA (:func:`stub_cuda`): a
    perf-counter reading taken when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3


def stub_cuda(monkeypatch, calls: list[str], peak_bytes: float = 3.0 * 2**30) -> None:
    """The ``torch.cuda`` functions the runtime calls for a CUDA device, as on one H200 that
    used ``peak_bytes`` at its peak; every synchronization appends ``"sync"`` to ``calls``."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak_bytes)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


class TrainsOnFakeCuda(L.Callback):
    """Makes the module say it is on ``cuda:0`` from fit start until training starts (when the
    runtime's callbacks, which run before this one, capture the device), then puts it back: the
    tensors stay on the CPU. After training, Lightning's teardown calls ``module.cpu()``, as it
    does on a GPU. Use with :func:`stub_cuda`."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module._device = torch.device("cuda", 0)

    def on_train_start(self, trainer, pl_module) -> None:
        assert pl_module.device.type == "cuda"  # what the callbacks before this one saw
        pl_module._device = torch.device("cpu")
