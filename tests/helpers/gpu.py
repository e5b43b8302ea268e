"""What the GPU tests compare, written so that a CPU test runs the same comparison with the CPU
standing in for the GPU."""

from __future__ import annotations

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
