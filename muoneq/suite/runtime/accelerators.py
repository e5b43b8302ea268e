"""Ascend NPU support for Lightning, and device helpers shared by the runtime.

Lightning has no NPU accelerator upstream. :class:`NPUAccelerator` is registered as ``"npu"``
in Lightning's ``AcceleratorRegistry`` (``Trainer(accelerator="npu")`` works once this module
is imported) and imports ``torch_npu`` only when an NPU run is asked for. The trainer factory
pairs it with the ``hccl`` process-group backend and NPU autocast
(``MixedPrecision(..., device="npu")``): Lightning's defaults would pick ``gloo`` and CUDA
autocast.
"""

from __future__ import annotations

import importlib
import resource
import time
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry

NPU_BACKEND = "hccl"

TORCH_NPU_MISSING = (
    "trainer.accelerator=npu needs the Ascend PyTorch adapter torch_npu (and the CANN toolkit), "
    "which is not installed; install the torch_npu build matching your torch version "
    "(https://gitee.com/ascend/pytorch, e.g. pip install torch-npu==<torch version>) and source "
    "CANN's set_env.sh before running, or choose another trainer.accelerator"
)


def torch_npu():
    """Import and return ``torch_npu`` (it registers ``torch.npu``), or explain how to get it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise RuntimeError(TORCH_NPU_MISSING) from err


class NPUAccelerator(Accelerator):
    """Lightning accelerator for Huawei Ascend NPUs (through ``torch_npu``)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise ValueError(f"NPUAccelerator: expected an npu device, got {device}")
        torch_npu()
        torch.npu.set_device(device)

    def teardown(self) -> None:
        if hasattr(torch, "npu"):
            torch.npu.empty_cache()

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        if isinstance(devices, str):
            devices = devices.strip()
            if devices in ("auto", "-1"):
                return list(range(NPUAccelerator.auto_device_count()))
            return [int(d) for d in devices.split(",") if d]
        if isinstance(devices, int):
            count = NPUAccelerator.auto_device_count() if devices == -1 else devices
            return list(range(count))
        return list(devices)

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        torch_npu()
        return torch.npu.device_count()

    @staticmethod
    def is_available() -> bool:
        try:
            torch_npu()
        except RuntimeError:
            return False
        return torch.npu.is_available()

    @staticmethod
    def name() -> str:
        return "npu"

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return torch.npu.memory_stats(device)

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


if "npu" not in AcceleratorRegistry:
    NPUAccelerator.register_accelerators(AcceleratorRegistry)


# --------------------------------------------------------------------------- device helpers
def _device_module(device: torch.device):
    """``torch.cuda`` / ``torch.npu`` for an accelerator device, ``None`` for the CPU."""
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type)
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (so wall-clock step times are real)."""
    if (module := _device_module(device)) is not None:
        module.synchronize(device)


def timestamp(device: torch.device):
    """A point in time that costs no synchronization: on an accelerator a timing event recorded
    on the device's current stream (it marks when the device reaches the work queued so far),
    on the CPU ``time.perf_counter()``. :func:`durations` reads them."""
    if (module := _device_module(device)) is None:
        return time.perf_counter()
    event = module.Event(enable_timing=True)
    event.record()
    return event


def durations(spans: list[tuple]) -> list[float]:
    """Seconds from start to end of each ``(start, end)`` pair of :func:`timestamp`s of one
    device, taken in order; for device events this waits once, until the device has reached the
    last end (a synchronization)."""
    if not spans or isinstance(spans[0][0], float):
        return [end - start for start, end in spans]
    spans[-1][1].synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in spans]


def reset_peak_memory(device: torch.device) -> None:
    if (module := _device_module(device)) is not None:
        module.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """``(bytes, kind)``: peak tensor memory allocated on an accelerator
    (``"device_allocated"``), or the process's peak resident set size on the CPU
    (``"host_rss"``, which includes the Python interpreter and libraries)."""
    if (module := _device_module(device)) is not None:
        return float(module.max_memory_allocated(device)), "device_allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0, "host_rss"


#: Dense bf16 peak TFLOP/s per device (vendor datasheets), by a substring of the CUDA device
#: name, most specific first: what MFU is measured against (other devices need the task's own
#: peak, e.g. ``task.peak_tflops`` of the language task).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("H20", 148.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
)


def device_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` from :data:`PEAK_TFLOPS`, or ``None`` if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)
