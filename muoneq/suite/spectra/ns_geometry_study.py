"""The synthetic study of the paper's Figure 1: spectral spread, normalization and
finite-step NS error.

Two families of random matrices with controlled shapes and spectral spread:

* ``rotation`` – rotation-invariant spectra ``U·diag(σ)·Vᵀ`` with Haar-random ``U``, ``V`` and
  ``σ`` geometrically spaced from 1 down to ``1/κ`` (the spread is ``κ``);
* ``scale`` – scale-imbalanced ``D₁·G·D₂`` with ``G`` standard Gaussian and diagonal scales drawn
  log-uniformly from ``[1, ρ]`` on both sides (the spread is the range ``ρ``).

For every matrix and every normalization none/R/C/RC it records eq. (5)
(finite-step error, preconditioning bias, total), the relative error curve over NS steps 0..K
with Theorem 3.1's bound, and the spectral metrics of the normalized matrix (condition number
before = mode ``none``). Results go to a run folder: ``summary.csv`` (one row per matrix ×
mode), ``curves.csv`` (one row per step), PNG figures and TensorBoard summaries. The study
resumes: a matrix whose rows are already in ``summary.csv`` is not computed again.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import time
import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from muoneq.diagnostics.ns_error import ModeDiagnostics, error_decomposition
from muoneq.functional import MODES
from muoneq.suite.files import atomic_open

FAMILIES = ("rotation", "scale")
FULL_SIZES = ((1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096))
QUICK_SIZES = ((128, 128), (128, 512), (512, 128), (512, 512))

SUMMARY_FIELDS = (
    "family", "spread", "m", "n", "seed", "mode", "rank", "stable_rank", "condition_number",
    "entropy", "ns_error", "ns_rel_error", "bias", "total_error", "seconds",
)
METRIC_FIELDS = SUMMARY_FIELDS[SUMMARY_FIELDS.index("stable_rank"):SUMMARY_FIELDS.index("seconds")]
CURVE_FIELDS = ("family", "spread", "m", "n", "seed", "mode", "step", "rel_error", "bound")


@dataclass(frozen=True)
class StudyConfig:
    """What the study measures. ``report_step`` is the K of "NS5" in the summary columns."""

    sizes: tuple[tuple[int, int], ...] = FULL_SIZES
    kappas: tuple[float, ...] = (10.0, 100.0, 1000.0)
    scale_ranges: tuple[float, ...] = (10.0, 100.0, 1000.0)
    seeds: int = 1
    steps: int = 10
    report_step: int = 5
    coefficients: str = "quintic"
    ns_dtype: str = "float64"
    eps: float = 1e-8
    modes: tuple[str, ...] = MODES
    families: tuple[str, ...] = FAMILIES
    device: str = "cpu"

    def __post_init__(self):
        if not self.sizes or any(len(s) != 2 or min(s) < 2 for s in self.sizes):
            raise ValueError(f"sizes: expected m×n pairs with m, n ≥ 2, got {self.sizes!r}")
        if any(k <= 1 for k in self.kappas):
            raise ValueError(f"kappas: every κ must be > 1, got {self.kappas!r}")
        if any(r < 1 for r in self.scale_ranges):
            raise ValueError(f"scale_ranges: every range must be ≥ 1, got {self.scale_ranges!r}")
        if self.seeds < 1:
            raise ValueError(f"seeds: expected ≥ 1, got {self.seeds}")
        if self.steps < 0:
            raise ValueError(f"steps: expected an integer ≥ 0, got {self.steps}")
        if not 0 <= self.report_step <= self.steps:
            raise ValueError(
                f"report_step: must lie in [0, steps={self.steps}], got {self.report_step}"
            )
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device: unknown device {self.device!r} (cpu, cuda, cuda:1, …)") \
                from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but no CUDA device is available")
        unknown = set(self.families) - set(FAMILIES)
        if unknown or not self.families:
            raise ValueError(
                f"families: unknown {sorted(unknown)}; allowed: {', '.join(FAMILIES)}"
            )

    def spreads(self, family: str) -> tuple[float, ...]:
        return self.kappas if family == "rotation" else self.scale_ranges

    def cases(self) -> Iterator[tuple[str, float, int, int, int]]:
        """Every matrix of the study as ``(family, spread, m, n, seed)``."""
        for family in self.families:
            for spread in self.spreads(family):
                for m, n in self.sizes:
                    for seed in range(self.seeds):
                        yield family, spread, m, n, seed


# ------------------------------------------------------------------ synthetic matrices
def _generator(*key) -> torch.Generator:
    """A CPU generator seeded from the case key, so each matrix is reproducible on its own."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def haar_orthonormal(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """``rows×cols`` matrix with orthonormal columns, Haar-distributed (QR with sign fix)."""
    Q, R = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))
    return Q * torch.sgn(torch.diagonal(R)).unsqueeze(0)


def rotation_invariant(m: int, n: int, kappa: float, generator: torch.Generator) -> Tensor:
    """``U·diag(σ)·Vᵀ`` with σ geometric from 1 to ``1/κ`` (exact condition number ``κ``)."""
    k = min(m, n)
    sigma = kappa ** (-torch.arange(k, dtype=torch.float64) / (k - 1))
    U = haar_orthonormal(m, k, generator)
    V = haar_orthonormal(n, k, generator)
    return (U * sigma) @ V.T


def scale_imbalanced(m: int, n: int, scale_range: float, generator: torch.Generator) -> Tensor:
    """``D₁·G·D₂``: Gaussian ``G``, row and column scales log-uniform in ``[1, scale_range]``."""
    G = torch.randn(m, n, generator=generator, dtype=torch.float64)
    log_range = math.log(scale_range)
    d1 = torch.exp(torch.rand(m, 1, generator=generator, dtype=torch.float64) * log_range)
    d2 = torch.exp(torch.rand(1, n, generator=generator, dtype=torch.float64) * log_range)
    return d1 * G * d2


def make_matrix(family: str, spread: float, m: int, n: int, seed: int) -> Tensor:
    generator = _generator(family, spread, m, n, seed)
    if family == "rotation":
        return rotation_invariant(m, n, spread, generator)
    return scale_imbalanced(m, n, spread, generator)


# ------------------------------------------------------------------ running and resuming
@dataclass
class StudyResult:
    """Rows of ``summary.csv`` and ``curves.csv`` (as dicts of strings/numbers)."""

    summary: list[dict] = field(default_factory=list)
    curves: list[dict] = field(default_factory=list)


def _key(row: dict) -> tuple:
    return (row["family"], float(row["spread"]), int(row["m"]), int(row["n"]), int(row["seed"]))


def _read_csv(path: Path) -> list[dict]:
    """Complete rows only: a line cut short by a kill has empty trailing fields."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if all(v not in (None, "") for v in r.values())]


def _write_csv(path: Path, fields, rows) -> None:
    """Rewrite ``path`` atomically (a kill leaves the old or the new file, never half of one)."""
    with atomic_open(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _append_csv(path: Path, fields, rows) -> None:
    with path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=fields).writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def _rows(case, diagnostics: dict[str, ModeDiagnostics], report_step: int, seconds: float):
    family, spread, m, n, seed = case
    head = dict(family=family, spread=spread, m=m, n=n, seed=seed)
    summary, curves = [], []
    for mode, d in diagnostics.items():
        summary.append({
            **head, "mode": mode, "rank": d.rank, "stable_rank": d.stable_rank,
            "condition_number": d.condition_number, "entropy": d.entropy,
            "ns_error": d.finite_step_curve[report_step],
            "ns_rel_error": d.relative_curve[report_step], "bias": d.bias,
            "total_error": d.total_curve[report_step], "seconds": round(seconds, 3),
        })
        curves += [
            {**head, "mode": mode, "step": k, "rel_error": e, "bound": b}
            for k, (e, b) in enumerate(zip(d.relative_curve, d.bound_curve, strict=True))
        ]
    return summary, curves


def _prepare_folder(out: Path, config: StudyConfig, fresh: bool) -> None:
    """Create ``out``; refuse to mix results of a different configuration into it."""
    saved = out / "config.json"
    wanted = json.loads(json.dumps(dataclasses.asdict(config)))
    if fresh and out.exists():
        for name in ("config.json", "summary.csv", "curves.csv", "figures", "tensorboard"):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)
    if saved.exists():
        previous = json.loads(saved.read_text())
        # The device does not change the results; a run may resume on another one.
        diff = sorted(k for k in wanted if k != "device" and previous.get(k) != wanted[k])
        if diff:
            raise ValueError(
                f"out: {out} holds a study with a different configuration (differs in: "
                f"{', '.join(diff)}); pick another --out, or pass --fresh to start over there"
            )
    saved.write_text(json.dumps(wanted, indent=2) + "\n")


def run_study(
    config: StudyConfig, out: str | Path, *, fresh: bool = False, log=print
) -> StudyResult:
    """Measure every case of ``config`` into ``out`` (resuming), then return all rows."""
    out = Path(out)
    _prepare_folder(out, config, fresh)
    summary_path, curves_path = out / "summary.csv", out / "curves.csv"
    summary = _read_csv(summary_path)
    done = {k for k, c in _count(summary).items() if c == len(config.modes)}
    summary = [r for r in summary if _key(r) in done]
    curves = [r for r in _read_csv(curves_path) if _key(r) in done]
    # Rows of a case interrupted half-way are dropped, then the case is measured again.
    _write_csv(summary_path, SUMMARY_FIELDS, summary)
    _write_csv(curves_path, CURVE_FIELDS, curves)
    cases = [c for c in config.cases() if (c[0], float(c[1]), *c[2:]) not in done]
    if done:
        log(f"resuming in {out}: {len(done)} matrices done, {len(cases)} to go")
    device = torch.device(config.device)
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        M = make_matrix(*case).to(device)
        diagnostics = error_decomposition(
            M, config.modes, config.steps, config.coefficients, config.ns_dtype, config.eps
        )
        seconds = time.perf_counter() - start
        new_summary, new_curves = _rows(case, diagnostics, config.report_step, seconds)
        # Curves first: a case counts as done only once its summary rows are written.
        _append_csv(curves_path, CURVE_FIELDS, new_curves)
        _append_csv(summary_path, SUMMARY_FIELDS, new_summary)
        summary += new_summary
        curves += new_curves
        family, spread, m, n, seed = case
        log(f"[{i}/{len(cases)}] {family} spread={spread:g} {m}x{n} seed={seed}: "
            + ", ".join(f"{mo} {d.relative_curve[config.report_step]:.3f}"
                        for mo, d in diagnostics.items())
            + f" (NS{config.report_step} rel. error; {seconds:.1f}s)")
    return StudyResult(summary=summary, curves=curves)


def _count(rows: list[dict]) -> dict[tuple, int]:
    counts: dict[tuple, int] = defaultdict(int)
    for r in rows:
        counts[_key(r)] += 1
    return counts


# ------------------------------------------------------------------ aggregation
def aggregate(rows: list[dict], by: tuple[str, ...], values: tuple[str, ...]) -> dict[tuple, dict]:
    """Mean of ``values`` over the rows sharing ``by`` (geometric mean for condition numbers)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(_typed(k, r[k]) for k in by)].append(r)
    out = {}
    for key, members in groups.items():
        stats = {}
        for v in values:
            xs = [float(r[v]) for r in members]
            if v == "condition_number":
                stats[v] = math.exp(sum(math.log(x) for x in xs) / len(xs))
            else:
                stats[v] = sum(xs) / len(xs)
        out[key] = stats
    return out


def _typed(name: str, value):
    if name in ("m", "n", "seed", "step", "rank"):
        return int(value)
    if name == "spread":
        return float(value)
    return value


def summary_table(result: StudyResult, config: StudyConfig) -> str:
    """Markdown table: per family and spread, the mean over sizes and seeds of each mode's
    NS-K relative error, condition number (geometric mean) and bias."""
    k = config.report_step
    stats = aggregate(result.summary, ("family", "spread", "mode"),
                      ("ns_rel_error", "condition_number", "bias", "total_error"))
    lines = [
        f"| family | spread | mode | NS{k} rel. error | κ after S | bias ‖Orth(S(M))−Orth(M)‖_F "
        f"| total ‖NS{k}(S(M))−Orth(M)‖_F |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for family in config.families:
        for spread in config.spreads(family):
            for mode in config.modes:
                s = stats.get((family, float(spread), mode))
                if s is None:
                    continue
                lines.append(
                    f"| {family} | {spread:g} | {mode} | {s['ns_rel_error']:.3f} | "
                    f"{s['condition_number']:.3g} | {s['bias']:.2f} | {s['total_error']:.2f} |"
                )
    return "\n".join(lines)


# ------------------------------------------------------------------ figures and TensorBoard
def write_outputs(result: StudyResult, config: StudyConfig, out: str | Path) -> list[Path]:
    """PNG figures, ``summary.md`` and TensorBoard summaries from the rows (re-derivable)."""
    from torch.utils.tensorboard import SummaryWriter

    from muoneq.suite.spectra import figures

    out = Path(out)
    fig_dir = out / "figures"
    fig_dir.mkdir(exist_ok=True)
    tb_dir = out / "tensorboard"
    if tb_dir.exists():  # derived data: rewrite rather than append duplicate events
        shutil.rmtree(tb_dir)
    curve_stats = aggregate(result.curves, ("family", "spread", "m", "n", "mode", "step"),
                            ("rel_error", "bound"))
    summary_stats = aggregate(result.summary, ("family", "spread", "m", "n", "mode"),
                              METRIC_FIELDS)
    table = summary_table(result, config)
    (out / "summary.md").write_text(table + "\n")
    paths = []
    with SummaryWriter(str(tb_dir)) as writer:
        writer.add_text("summary", table)
        bound_panels = []
        for family in config.families:
            curves, bounds = defaultdict(list), defaultdict(list)
            for (fam, spread, m, n, mode, step), s in sorted(curve_stats.items()):
                if fam != family:
                    continue
                curves[(spread, m, n, mode)].append(s["rel_error"])
                bounds[(spread, m, n, mode)].append(s["bound"])
                writer.add_scalar(f"{family}/spread_{spread:g}/{m}x{n}/{mode}/rel_error",
                                  s["rel_error"], step)
            summary = {k[1:]: v for k, v in summary_stats.items() if k[0] == family}
            spreads = config.spreads(family)
            args = (family, spreads, config.sizes, config.modes, config.report_step)
            for name, fig in (
                (f"fig1_{family}", figures.study_fig1(curves, summary, *args)),
                (f"decomposition_{family}", figures.study_decomposition(summary, *args)),
            ):
                paths.append(_save(fig, fig_dir / f"{name}.png", writer, name))
            m, n = config.sizes[-1]
            for spread in sorted({spreads[0], spreads[-1]}):
                bound_panels.append((
                    f"{family}, spread {spread:g}, {m}×{n}",
                    {mo: curves[(float(spread), m, n, mo)] for mo in config.modes},
                    {mo: bounds[(float(spread), m, n, mo)] for mo in config.modes},
                ))
        fig = figures.study_bound(bound_panels, config.modes)
        paths.append(_save(fig, fig_dir / "theorem_bound.png", writer, "theorem_bound"))
    return paths


def _save(fig, path: Path, writer, tag: str) -> Path:
    fig.savefig(path, dpi=110)
    writer.add_figure(tag, fig)
    return path
