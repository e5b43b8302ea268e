"""What a measurement ran on: the device's name, the CPU threads and cores, the machine's load.

Timings (a run's step time, a benchmark) depend on them as much as on the code: a run records
them beside its step times in ``metrics.json`` (:class:`muoneq.suite.runtime.callbacks.StepStats`)
and the report says what its step-time comparisons were measured on, and whether the machine
was busy (:mod:`muoneq.suite.report.machine`).
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (thread counts are reported apart)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable threads, all processes), or None where
    the system keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
