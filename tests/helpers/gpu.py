"""What the GPU tests compare, written so that a CPU test runs the same comparison with the CPU
standing in for the GPU."""

from __future__ import annotations

import time

import lightning as L
import torch

from muoneq.newton_schulz import QUINTIC, StackIteration, newton_schulz, resolve_dtype

#: The dtype Newton–Schulz runs in on a GPU by default (``ns_dtype="auto"``).
GPU_NS_DTYPE = resolve_dtype("auto", "cuda")

#: Stacks ``(k, m, n)`` the Triton kernels are checked on against torch's products: sizes that
#: are not multiples of the kernels' 64-wide tiles, wide and tall, stacks of one and of many
#: (Triton's interpreter runs them on a CPU, slowly); on a GPU also full-size ones
KERNEL_STACKS = [(1, 65, 130), (3, 130, 65), (5, 33, 33), (2, 1, 70)]
KERNEL_STACKS_FULL = [(1, 768, 3072), (12, 3072, 768), (48, 129, 1000), (1, 2049, 2047)]
#: how many units of the dtype's rounding (of the largest entry) one Newton–Schulz step on the
#: kernels may differ from torch's by: bf16 rounds each of the step's three products once, as
#: torch does; float32 sums its products in another order
STEP_UNITS = {torch.bfloat16: 4, torch.float32: 16}


def random_stack(shape, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def triton_step_units(shape, dtype: torch.dtype, device: str) -> float:
    """The largest difference between one quintic Newton–Schulz step of a random stack on the
    Triton backend and on torch's (``newton_schulz(..., backend=...)``, the same normalized
    input), in units of ``dtype``'s rounding of the largest entry."""
    G = random_stack(shape, device)
    steps = {backend: newton_schulz(G, 1, "quintic", dtype, backend=backend)
             for backend in ("torch", "triton")}
    want = steps["torch"].double()
    difference = (steps["triton"].double() - want).abs().max().item()
    return difference / (torch.finfo(dtype).eps * want.abs().max().item())


def triton_ns5_errors(shape, device: str) -> dict[str, float]:
    """bf16 NS5 of a random stack on each backend: relative Frobenius distance to a float64
    NS5 of the same stack (the accuracy rule: the kernels within 1.5× torch's)."""
    G = random_stack(shape, device)
    exact = newton_schulz(G.double().cpu(), 5, dtype=torch.float64)
    return {backend: ((newton_schulz(G, 5, "quintic", torch.bfloat16, backend=backend)
                       .double().cpu() - exact).norm() / exact.norm()).item()
            for backend in ("torch", "triton")}


#: the most two backends' bf16 NS5 of the same stack may differ (relative Frobenius distance):
#: bf16 rounds at 2⁻⁸ per operation, and different roundings compound over the steps
NS5_AGREEMENT = 2e-2


def relative_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def far_apart_stack_distance(device: str, m: int = 64, n: int = 96) -> float:
    """A stack of 3 bf16 matrices whose batch stride is 2³⁰ elements, so that the last starts
    past element 2³¹ (the offsets of a stack of more than 2³¹ elements), iterated five steps in
    the Triton kernels (:func:`muoneq.ns_triton.iterate_stack`): its distance to torch's
    iteration of the same matrices stored contiguously. The 4 GiB of storage are allocated, but
    only the three matrices touched (on a CPU they are address space only)."""
    from muoneq import ns_triton

    base = torch.empty(2 * 2**30 + m * n, dtype=torch.bfloat16, device=device)
    X = base.as_strided((3, m, n), (2**30, n, 1))
    G = random_stack((3, m, n), device)
    X.copy_(G / G.norm(dim=(-2, -1), keepdim=True))
    contiguous = X.contiguous()

    def buffers(like):
        gram = torch.empty(3, m, m, dtype=torch.bfloat16, device=device)
        return {"ns_other": torch.empty_like(like, memory_format=torch.contiguous_format),
                "ns_gram": gram, "ns_poly": torch.empty_like(gram)}

    coefficients = (QUINTIC,) * 5
    found = buffers(X)
    got = ns_triton.iterate_stack(X, coefficients, other=found["ns_other"],
                                  gram=found["ns_gram"], poly=found["ns_poly"])
    return relative_distance(got, StackIteration().iterate(contiguous, coefficients,
                                                           buffers(contiguous)))



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
