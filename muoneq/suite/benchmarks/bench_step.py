"""Time one optimizer step on realistic matrix sets: ``muoneq bench`` (``make bench``).

For each matrix set (GPT-2 small's hidden matrices, LLaMA2-130M's hidden matrices, ResNet-18's
conv filters) every contender owns a copy of the parameters with the same gradients, and the
contenders' steps are *interleaved* (each repeat runs each once, in rotating order) so that
load from other processes hits all of them alike. Reported per contender:

* ``ms``: median step time; ``vs_torch``/``vs_muon``: median over repeats of the per-repeat
  ratio to ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``) / to this project's Muon;
* ``gflops``: Newton–Schulz FLOPs of the set (``K·(4m²n + 2m³)`` per matrix) per second, and
  ``of_matmul``: that rate over a bf16 matmul rate measured in the same loop;
* ``peak_extra_mb``: memory allocated during one step beyond what existed before it (CUDA:
  the allocator's peak; CPU: the profiler's allocation trace), plus the scratch workspace
  our optimizers keep between steps (``workspace_mb``: ``optimizer.workspace_bytes``, within
  twice torch.optim.Muon's by default); per set, the stacked path's default workspace over
  torch.optim.Muon's peak extra memory measured in the same process (``workspace``);
* ``state_bytes``: persistent optimizer state (Muon keeps one buffer per matrix);
* ``err_gauss``/``err_decay``: relative Frobenius distance between the contender's direction
  and a float64 NS5 of the same (equilibrated) input — for a peer, a float64 run of the
  Newton–Schulz schedule it runs — worst over the set's shapes, for a Gaussian input and one
  whose singular values decay from 1 to 1e-3; ``x_torch_*``: the same figure over
  ``torch.optim.Muon``'s, worst over shapes (the accuracy rule: ≤ 1.5).

Beside ``torch.optim.Muon`` and this project's rows run the *peers*, the public Muon
implementations installed here (:mod:`muoneq.suite.benchmarks.peers`: heavyball's and the
``muon-optimizer`` package's; ``--peers`` with, without or only them); a peer that is not
installed gets one line saying so, printed and kept in the JSON (``missing_peers``).

The table is printed as Markdown and written as JSON with the device name (and, on a CPU,
torch's thread count). ``--quick`` runs miniature sets: its timings are smoke values (CI checks
that every path runs), and the output says so; the full run takes a few minutes on a 2-core
CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from muoneq.functional import diag_pre, lr_scale, matrix_shape
from muoneq.newton_schulz import (
    QUINTIC,
    Coefficients,
    dtype_name,
    newton_schulz,
    ns_flops,
    resolve_dtype,
)
from muoneq.optim import MuonEq
from muoneq.optim.distributed import balance
from muoneq.suite import code_version
from muoneq.suite.benchmarks import peers
from muoneq.suite.machine import device_name, load_average
from muoneq.suite.report.machine import BUSY_MARGIN, is_busy

NS_STEPS = 5
HPARAMS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}


# ----------------------------------------------------------------------------- matrix sets
def gpt2_small(quick: bool) -> list[tuple[int, ...]]:
    """Per block: attention ``c_attn`` (3d×d), ``c_proj`` (d×d), MLP ``c_fc`` (4d×d), ``c_proj``
    (d×4d); d = 768, 12 blocks (quick: d = 64, 2 blocks)."""
    d, layers = (64, 2) if quick else (768, 12)
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


def gpt2_block(quick: bool) -> list[tuple[int, ...]]:
    """One block of :func:`gpt2_small`: full-size matrices timed in minutes on a 2-core CPU
    (quick: d = 64)."""
    d = 64 if quick else 768
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def llama2_130m(quick: bool) -> list[tuple[int, ...]]:
    """Per block: q, k, v, o (d×d), gate and up (f×d), down (d×f); d = 768, f = 2048, 12 blocks
    (the paper's LLaMA2-130M; quick: d = 64, f = 176, 2 blocks)."""
    d, f, layers = (64, 176, 2) if quick else (768, 2048, 12)
    return ([(d, d)] * 4 + [(f, d)] * 2 + [(d, f)]) * layers


def resnet18_filters(quick: bool) -> list[tuple[int, ...]]:
    """The conv filters of ResNet-18 after the stem (torchvision's layout; quick: channels/8)."""
    from torchvision.models import resnet18

    shapes = [tuple(p.shape) for name, p in resnet18().named_parameters()
              if p.ndim == 4 and name != "conv1.weight"]
    if quick:
        shapes = [(o // 8, max(1, i // 8), kh, kw) for o, i, kh, kw in shapes]
    return shapes


MATRIX_SETS: dict[str, Callable[[bool], list[tuple[int, ...]]]] = {
    "gpt2_small": gpt2_small,
    "gpt2_block": gpt2_block,
    "llama2_130m": llama2_130m,
    "resnet18": resnet18_filters,
}


# ----------------------------------------------------------------------------- the paper's loop
class PaperLoopMuonEq(torch.optim.Optimizer):
    """MuonEq-R as the authors' code runs it: one parameter at a time, their momentum
    ``buf ← β·buf + g`` with Nesterov ``g + β·buf``, row scaling from ``square().sum()``,
    Keller Jordan's unfused NS5 in bf16 (``X ← aX + (bA + cA²)X``), then the update."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @staticmethod
    def _ns5(G: Tensor) -> Tensor:
        a, b, c = QUINTIC
        X = G.bfloat16()
        if G.size(0) > G.size(1):
            X = X.T
        X = X / (X.norm() + 1e-7)
        for _ in range(NS_STEPS):
            A = X @ X.T
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.T if G.size(0) > G.size(1) else X

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad.view(p.size(0), -1)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(beta).add_(g)
                u = g.add(buf, alpha=beta)
                u = u * (u.square().sum(dim=1) + 1e-8).rsqrt()[:, None]
                u = self._ns5(u)
                p.mul_(1 - lr * wd)
                p.add_(u.view_as(p), alpha=-lr * lr_scale(matrix_shape(p), "rms"))


# ----------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    name: str
    build: Callable[[list[Tensor], dict], torch.optim.Optimizer]
    mode: str  # the DiagPre mode its direction applies (accuracy reference)
    ns_dtype: str  # the dtype its Newton–Schulz runs in on the benchmark's device
    flat: bool = False  # needs 2-D parameters (torch.optim.Muon rejects conv filters)
    #: the Newton–Schulz schedule its direction is compared with, run in float64
    coefficients: Coefficients = "quintic"
    #: the factor its step multiplies the orthogonalized direction of an m×n matrix by
    scale: Callable[[tuple[int, int]], float] = field(
        default=partial(lr_scale, lr_adjust="rms"))
    #: its step changes or clears ``p.grad``: it gets a copy of the gradients before every step
    fresh_grads: bool = False


#: ``--peers``: the peers beside every row ("with"), no peers ("without"), or the peers beside
#: torch.optim.Muon, our Muon and MuonEq-R only ("only")
PEER_CHOICES = ("with", "without", "only")
#: the rows kept beside the peers with ``--peers only`` (on a CPU MuonEq-R's stacked row too: the
#: default workspace's figure is read off it)
PEERS_ONLY_KEEP = ("torch.optim.Muon", "Muon (ours)", "MuonEq-R", "MuonEq-R (stacked)")


def peer_contenders() -> tuple[list[Contender], dict[str, str], list[str]]:
    """The installed peers as contenders, their packages (name → ``distribution version``),
    and one line for each peer that is not installed."""
    found, missing = peers.installed()
    rows = [Contender(peer.name, partial(peer.build, optimizer_class), "none", "bfloat16",
                      flat=peer.flat, coefficients=peer.coefficients, scale=peer.scale,
                      fresh_grads=True)
            for peer, _, optimizer_class in found]
    packages = {peer.name: f"{peer.distribution} {version}" for peer, version, _ in found}
    return rows, packages, missing


def contenders(device: torch.device, compile_ns: bool) -> list[Contender]:
    """torch.optim.Muon and our Muon (both bf16: the same algorithm; bit for bit on the
    per-matrix path, the CPU default), MuonEq's modes and paths at the default
    ``ns_dtype="auto"`` (bf16 on accelerators and on CPUs with native bf16 products, float32 on
    other CPUs), MuonEq-R in the other dtype, on a GPU also on this project's Triton kernels and
    with ``ns_backend="auto"``, and the authors' loop (bf16). The peers are added apart
    (:func:`peer_contenders`)."""
    auto = dtype_name(resolve_dtype("auto", device))
    other_dtype = "bfloat16" if auto == "float32" else "float32"

    def muoneq(name, mode, **options):
        dtype = options.get("ns_dtype", auto)
        return Contender(name, lambda params, hp: MuonEq(params, mode=mode, nesterov=True,
                                                         **hp, **options), mode, dtype)

    out = [
        Contender("torch.optim.Muon", lambda params, hp: torch.optim.Muon(
            params, nesterov=True, adjust_lr_fn="match_rms_adamw", **hp), "none", "bfloat16",
            flat=True),
        muoneq("Muon (ours)", "none", ns_dtype="bfloat16"),
        muoneq("MuonEq-R", "R"),
        muoneq(f"MuonEq-R ({other_dtype})", "R", ns_dtype=other_dtype),
        muoneq("MuonEq-C", "C"),
        muoneq("MuonEq-RC", "RC"),
        muoneq("MuonEq-R (gram)", "R", ns_algorithm="gram"),
        Contender("paper loop (R)", lambda params, hp: PaperLoopMuonEq(params, **hp), "R",
                  "bfloat16"),
    ]
    other = "per_matrix" if device.type != "cpu" else "stacked"
    out.append(muoneq(f"MuonEq-R ({other})", "R", batching=other))
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        # this project's Triton kernels, and the per-shape choice of the faster backend
        out += [muoneq(f"MuonEq-R ({backend})", "R", ns_backend=backend)
                for backend in ("triton", "auto")]
    if compile_ns:
        out.append(muoneq("MuonEq-R (compiled)", "R", compile=True))
    return out


# ----------------------------------------------------------------------------- measurements
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence the profiler's native start/stop chatter (it writes to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_extra_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Most memory allocated at once while ``fn`` runs, beyond what was allocated before."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as folder, quiet_native_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])


def operations(fn: Callable[[], None], device: torch.device) -> tuple[int, str]:
    """``(count, what)``: the kernels one call of ``fn`` launches on a CUDA device (kernels,
    copies and fills, from torch.profiler), or on a CPU the top-level aten operators it calls
    (each operator once, not the operators it calls in turn)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    synchronize(device)
    with quiet_native_stderr(), profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if cuda:
        return sum(e.device_type == DeviceType.CUDA for e in events), "CUDA kernels"

    def aten(event) -> bool:
        return event is not None and event.name.startswith("aten::")

    count = sum(aten(e) and not aten(e.cpu_parent) for e in events)
    return count, "top-level CPU operator calls"


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state (nested dicts too: heavyball keeps a
    parameter's state under an index)."""
    def size(value) -> int:
        if isinstance(value, Tensor):
            return value.numel() * value.element_size()
        return sum(map(size, value.values())) if isinstance(value, dict) else 0

    return sum(size(state) for state in opt.state.values())


def accuracy_input(shape: tuple[int, int], kind: str, gen: torch.Generator) -> Tensor:
    """A Gaussian matrix, or ``U·diag(s)·Vᵀ`` with random orthonormal U, V and ``s`` decaying
    geometrically from 1 to 1e-3."""
    m, n = shape
    if kind == "gaussian":
        return torch.randn(m, n, generator=gen)
    if kind != "decay":
        raise ValueError(f"accuracy input: unknown kind {kind!r}; allowed: gaussian, decay")
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -3, k, dtype=torch.float64)
    return ((U * s) @ V.T).float()


def direction_of(contender: Contender, shape: tuple[int, ...], G: Tensor, device) -> Tensor:
    """The contender's direction for momentum input ``G``: one step from zero with lr 1,
    momentum 0 and no weight decay leaves ``p = −a·O``."""
    full = shape if not contender.flat else matrix_shape(torch.empty(shape, device="meta"))
    p = nn.Parameter(torch.zeros(full, device=device))
    p.grad = G.reshape(full).to(device)
    opt = contender.build([p], {"lr": 1.0, "momentum": 0.0, "weight_decay": 0.0})
    opt.step()
    m, n = G.shape
    return (-p.detach().reshape(m, n).double() / contender.scale((m, n))).cpu()


def accuracy(entries: list[Contender], shapes, device) -> dict[str, dict[str, float]]:
    """Worst relative error over the set's distinct shapes, and worst ratio to torch's."""
    gen = torch.Generator().manual_seed(0)
    worst = {c.name: {} for c in entries}
    for shape in dict.fromkeys(shapes):
        mat = matrix_shape(torch.empty(shape, device="meta"))
        for kind in ("gaussian", "decay"):
            G = accuracy_input(mat, kind, gen)
            refs = {}
            errors = {}
            for c in entries:
                key = (c.mode, c.coefficients)
                if key not in refs:
                    refs[key] = newton_schulz(diag_pre(G.double(), c.mode, 1e-8), NS_STEPS,
                                              c.coefficients, torch.float64)
                ref = refs[key]
                errors[c.name] = ((direction_of(c, shape, G, device) - ref).norm()
                                  / ref.norm()).item()
            for c in entries:
                w = worst[c.name]
                w[f"err_{kind}"] = max(w.get(f"err_{kind}", 0.0), errors[c.name])
                ratio = errors[c.name] / errors["torch.optim.Muon"]
                w[f"x_torch_{kind}"] = max(w.get(f"x_torch_{kind}", 0.0), ratio)
    return worst


def matmul_rate(shapes, device, dtype=torch.bfloat16) -> Callable[[], float]:
    """A timer of ``X·Xᵀ`` and ``A·X`` on the set's costliest shape, repeated for about a
    tenth of the set's NS FLOPs; returns GFLOP/s."""
    mats = [matrix_shape(torch.empty(s, device="meta")) for s in shapes]
    m, n = sorted(max(mats, key=lambda s: ns_flops(s, 1)))
    X = torch.randn(m, n, device=device, dtype=dtype)
    A = torch.randn(m, m, device=device, dtype=dtype)
    calls = max(1, round(sum(ns_flops(s, NS_STEPS) for s in mats) / 10 / (4 * m * m * n)))

    def timed() -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(X, X.mT)
            torch.mm(A, X)
        synchronize(device)
        return calls * 4 * m * m * n / (time.perf_counter() - start) / 1e9

    return timed


def bench_set(shapes, entries: list[Contender], device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    values = [torch.randn(s, generator=gen).mul_(0.02).to(device) for s in shapes]
    opts = {}
    #: per contender, what runs before each of its steps, outside the timing: a fresh copy of
    #: the gradients for a step that changes or clears them, else nothing
    prepare = {}
    for c in entries:
        params = []
        for v, g in zip(values, grads, strict=True):
            p = nn.Parameter(v.reshape(v.size(0), -1).clone() if c.flat else v.clone())
            p.grad = g.view_as(p)
            params.append(p)
        prepare[c.name] = partial(fresh_grads, params, grads) if c.fresh_grads else no_op
        opts[c.name] = c.build(params, dict(HPARAMS))
    rate = matmul_rate(shapes, device)
    for name, opt in opts.items():  # warm up: first-touch allocations, BLAS packing, compiling
        prepare[name]()
        opt.step()
    rate()
    times = {c.name: [] for c in entries}
    rates = []
    for r in range(repeats):
        order = entries[r % len(entries):] + entries[: r % len(entries)]
        for c in order:
            prepare[c.name]()
            synchronize(device)
            start = time.perf_counter()
            opts[c.name].step()
            synchronize(device)
            times[c.name].append(time.perf_counter() - start)
        rates.append(rate())
    costs = [ns_flops(matrix_shape(torch.empty(s, device="meta")), NS_STEPS) for s in shapes]
    flops = sum(costs)
    matmul_gflops = statistics.median(rates)
    acc = accuracy(entries, shapes, device)
    rows = {}
    peaks = {}
    for c in entries:
        prepare[c.name]()
        peaks[c.name] = peak_extra_bytes(opts[c.name].step, device)
    for c in entries:
        t = times[c.name]
        ms = statistics.median(t) * 1e3
        rows[c.name] = {
            "ns_dtype": c.ns_dtype,
            "ms": ms,
            "vs_torch": statistics.median(
                a / b for a, b in zip(t, times["torch.optim.Muon"], strict=True)),
            "vs_muon": statistics.median(
                a / b for a, b in zip(t, times["Muon (ours)"], strict=True)),
            "gflops": flops / (ms / 1e3) / 1e9,
            "of_matmul": flops / (ms / 1e3) / 1e9 / matmul_gflops,
            "peak_extra_mb": (peaks[c.name]
                              + getattr(opts[c.name], "workspace_bytes", 0)) / 2**20,
            # of which the scratch kept between steps (optimizer.workspace_bytes), and its bound
            # (bytes, "auto" or None)
            "workspace_mb": getattr(opts[c.name], "workspace_bytes", 0) / 2**20,
            "workspace_limit": getattr(opts[c.name], "workspace_limit", None),
            "state_bytes": state_bytes(opts[c.name]),
            # the Newton–Schulz backend each stacked shape ran on (ns_backend="auto" chooses)
            "ns_backends": {f"{m}x{n}": name for (m, n), name in
                            getattr(opts[c.name], "planned_backends", {}).items()},
            **acc[c.name],
            "times_ms": [x * 1e3 for x in t],
        }
    ddp = {}
    for world in (2, 4, 8):
        loads = [0.0] * world
        for cost, owner in zip(costs, balance(costs, world), strict=True):
            loads[owner] += cost
        ddp[str(world)] = {
            "max_share_over_ideal": max(loads) / (sum(costs) / world),
            "within_bound": max(loads) <= sum(costs) / world + max(costs),
        }
    stacked = "MuonEq-R" if device.type != "cpu" else "MuonEq-R (stacked)"  # the stacked row
    torch_peak = peaks["torch.optim.Muon"]
    workspace = {"contender": stacked, "default_mb": opts[stacked].workspace_bytes / 2**20,
                 "chunks": sum(len(s.chunks) for s in opts[stacked]._planned().values()),
                 "torch_peak_extra_mb": torch_peak / 2**20,
                 "over_torch": opts[stacked].workspace_bytes / max(torch_peak, 1)}
    return {
        "matrices": len(shapes),
        "workspace": workspace,
        "parameters": sum(math.prod(s) for s in shapes),
        "ns_gflop": flops / 1e9,
        "matmul_gflops": matmul_gflops,
        "contenders": rows,
        "ddp_split": ddp,
    }


def no_op() -> None:
    pass


def fresh_grads(params: list[nn.Parameter], grads: list[Tensor]) -> None:
    """Give every parameter a copy of its gradient (for a step that changes or clears it)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.view_as(p).clone()


def device_label(device: torch.device) -> str:
    """The device as printed: a GPU's name, or the CPU's name with torch's thread count."""
    if device.type != "cpu":
        return device_name(device)
    return f"{device_name(device)} (CPU, {plural(torch.get_num_threads(), 'thread')})"


def sig3(x: float) -> str:
    """``x`` with three significant digits and no exponent for the magnitudes of the tables
    (0.0147, 0.147, 1.47, 14.7, 147, 1470)."""
    if x == 0 or abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def table(result: dict) -> str:
    repeats = result["repeats"]
    lines = []
    if result["quick"]:
        lines.append(f"QUICK RUN: miniature matrix sets, {plural(repeats, 'repeat')}: the timings "
                     "are smoke values (they check that every path runs), not measurements")
    if result.get("peers"):
        lines.append("Peers (public Muon implementations, each with its own Newton–Schulz "
                     "schedule in bf16; their error columns against a float64 run of that "
                     "schedule): " + ", ".join(f"{name} ({package})" for name, package
                                               in result["peers"].items()) + ".")
    lines += [f"Not run: {line}." for line in result.get("missing_peers", [])]
    for name, data in result["sets"].items():
        lines.append(f"\n**{name}**{' (quick: smoke values)' if result['quick'] else ''} — "
                     f"{data['matrices']} matrices, {data['parameters'] / 1e6:.2g}M parameters, "
                     f"{sig3(data['ns_gflop'])} GFLOP of NS5 per step; bf16 matmul "
                     f"{sig3(data['matmul_gflops'])} GFLOP/s (median over repeats)\n")
        lines.append(f"| contender | NS dtype | ms/step, median of {repeats} | × torch, median "
                     "of per-repeat ratios | × Muon (ours), median of per-repeat ratios | NS5 "
                     "GFLOP/s | of bf16 matmul | peak extra MB | state MB | err Gauss (× torch) "
                     "| err decay (× torch) |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for cname, row in data["contenders"].items():
            lines.append(
                f"| {cname} | {row['ns_dtype']} | {sig3(row['ms'])} | {row['vs_torch']:.3f} | "
                f"{row['vs_muon']:.3f} | "
                f"{sig3(row['gflops'])} | {row['of_matmul']:.2f} | {sig3(row['peak_extra_mb'])} | "
                f"{sig3(row['state_bytes'] / 2**20)} | {row['err_gaussian']:.2e} "
                f"({row['x_torch_gaussian']:.2f}) | {row['err_decay']:.2e} "
                f"({row['x_torch_decay']:.2f}) |"
            )
        lines.append("\nA repeat times every contender once, in rotating order; a ratio column is "
                     "the median over repeats of the contender's time over the reference's time "
                     "in the same repeat, so it need not equal the ratio of the two ms medians. "
                     "NS5 GFLOP/s counts the standard NS5 FLOPs (for the Gram order, which does "
                     "fewer, an effective rate).")
        split = ", ".join(f"W={w}: {d['max_share_over_ideal']:.3f}×"
                          for w, d in data["ddp_split"].items())
        lines.append(f"\nDDP split, busiest rank's NS FLOPs over total/W: {split}")
        w = data.get("workspace")
        if w is None:
            continue
        lines.append(f"\nDefault workspace of the stacked step ({w['contender']}): "
                     f"{sig3(w['default_mb'])} MiB in {w['chunks']} chunks, "
                     f"{w['over_torch']:.2f}× torch.optim.Muon's peak extra memory "
                     f"({sig3(w['torch_peak_extra_mb'])} MiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="muoneq bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sets", default=",".join(MATRIX_SETS),
                        help=f"comma-separated, from: {', '.join(MATRIX_SETS)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per contender (default 7, quick: 3)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--compile", action="store_true",
                        help="add MuonEq-R with torch.compile'd Newton–Schulz")
    parser.add_argument("--peers", default="with", choices=PEER_CHOICES,
                        help="the installed public Muon implementations: beside every row "
                        "(with, the default), not at all (without), or beside torch.optim.Muon, "
                        "our Muon and MuonEq-R's rows only (only)")
    parser.add_argument("--quick", action="store_true", help="miniature sets (smoke test)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default runs/bench/step_<device>[_quick].json)")
    args = parser.parse_args(argv)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in MATRIX_SETS]
    if unknown or not sets:
        parser.error(f"--sets: unknown {unknown}; allowed: {', '.join(MATRIX_SETS)}")
    if args.device not in ("auto", "cpu", "cuda"):
        parser.error(f"--device: expected auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats: must be ≥ 1")
    entries = contenders(device, args.compile)
    packages, missing = {}, []
    if args.peers != "without":
        peer_rows, packages, missing = peer_contenders()
        if args.peers == "only":
            entries = [c for c in entries if c.name in PEERS_ONLY_KEEP]
        entries += peer_rows
    for line in missing:
        print(f"[bench] {line}", flush=True)
    result = {
        "device": device_name(device),
        "device_label": device_label(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": code_version.taken().commit, "git_dirty": code_version.taken().dirty,
        "cores": os.cpu_count(),
        "command": "muoneq bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": repeats,
        "quick": args.quick,
        "hparams": HPARAMS,
        "peers": packages,
        "missing_peers": missing,
        "sets": {},
    }
    loads = [load_average() or 0.0]
    for name in sets:
        print(f"[bench] {name} …", flush=True)
        result["sets"][name] = bench_set(MATRIX_SETS[name](args.quick), entries, device, repeats)
        loads.append(load_average() or 0.0)
    result["load_avg"] = [min(loads), max(loads)]
    out = Path(args.out or f"runs/bench/step_{device.type}{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    text = f"{heading(result)}\n\n{table(result)}\n{busy_note(loads, result['cores'])}"
    out.with_suffix(".md").write_text(text)
    print(text, end="")
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


def busy_note(loads: list[float], cores: int) -> str:
    """A paragraph when the machine's 1-minute load exceeded its cores by more than
    :data:`~muoneq.suite.report.machine.BUSY_MARGIN` while the bench ran (as a report's timing
    note says it): the times are then the machine's as much as the optimizers'."""
    if not is_busy(max(loads), cores):
        return ""
    return (f"\nThe machine was busy: a 1-minute load of {min(loads):.1f} to {max(loads):.1f} on "
            f"{cores} cores (over {BUSY_MARGIN:.0%} above them); the times are the machine's as "
            "much as the optimizers': measure again on an idle machine\n")


def heading(result: dict) -> str:
    """What ran where: the device, torch, the date, the commit, the command and the machine's
    load (a load above the cores means other work shared them)."""
    commit = code_version.short_commit(result["git_commit"], result["git_dirty"])
    low, high = result["load_avg"]
    return (f"# muoneq bench on {result['device_label']}\n\n{result['date']}, muoneq at "
            f"{commit}, torch {result['torch']}, {plural(result['repeats'], 'repeat')}, "
            f"`{result['command']}`; 1-minute load average {low:.2f} to {high:.2f} while it ran "
            f"({plural(result['cores'], 'core')}).")


if __name__ == "__main__":
    sys.exit(main())
