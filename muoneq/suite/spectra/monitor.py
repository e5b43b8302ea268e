"""``SpectralMonitor``: measure the pre-NS momentum during training (the paper's Figures 2, 6
and 7), without touching the trajectory.

At a few chosen optimizer steps (default 1%, 10%, 50% and 100% of training) the callback rebuilds,
for every selected weight, the matrices the optimizer has just fed to DiagPre and Newton–Schulz,

    M̃ = lerp(G, M', β) = βM' + (1−β)G   (Nesterov),   M̃ = M'   (otherwise),

from the gradient ``G`` (``p.grad``) and the updated momentum buffer ``M'`` (the optimizer state
``momentum_buffer``) of the step that just finished, cut into the ``(out, in·…)`` blocks the
optimizer orthogonalizes by the parameter's :class:`muoneq.layout.MatrixLayout` (its group's
``transposed``, ``batch_dims`` and ``splits``: a ``transformers`` ``Conv1D`` is measured as
``(out, in)``, an expert bank expert by expert, a split fused Q/K/V block by block), and runs
:func:`muoneq.diagnostics.error_decomposition` on float64 copies for every normalization:
stable rank, entropy, condition number of ``S(M̃)``, the relative NS error curve over steps
0..K and the finite-step error and bias of eq. (5).

Why after the step (``on_train_batch_end``) rather than in ``on_before_optimizer_step``: Lightning
clips gradients *after* that hook, so ``G`` seen there is not the one the optimizer uses. After the
step, ``p.grad`` still holds the (clipped, unscaled, all-reduced) gradient, Lightning zeroes it only
in the next step, and the buffer holds ``M'``: the matrix above is exactly the optimizer's.

Supported optimizers: those keeping the EMA momentum in ``state[p]["momentum_buffer"]`` with
``momentum``/``nesterov`` in the param group (``muoneq.MuonEq``, Muon and the other subclasses of
``HybridOrthogonalOptimizer``, ``torch.optim.Muon``). Under DDP only global rank 0 measures and
writes; FSDP2 ``DTensor`` shards are gathered with ``full_tensor()`` on every rank first.
"""

from __future__ import annotations

import csv
import fnmatch
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from muoneq.diagnostics.ns_error import ModeDiagnostics, error_decomposition
from muoneq.functional import MODES, canonical_mode
from muoneq.layout import MatrixLayout
from muoneq.newton_schulz import normalize_coefficients, resolve_dtype
from muoneq.optim.hybrid import HybridOrthogonalOptimizer
from muoneq.suite.files import atomic_open

METRICS = ("rank", "stable_rank", "condition_number", "entropy", "ns_error", "ns_rel_error",
           "bias", "total_error")


@dataclass(frozen=True)
class Watched:
    """A measured parameter: its label (the module's name, ``module.param`` for a parameter
    other than ``weight``), its optimizer and group, and the matrices the optimizer sees."""

    label: str
    param: Tensor
    optimizer: torch.optim.Optimizer
    group: dict
    layout: MatrixLayout

    def tag(self, block: int) -> str:
        """The TensorBoard name of one block: the label, with ``/block<i>`` when there are
        several."""
        return self.label if len(self.layout.blocks) == 1 else f"{self.label}/block{block}"


def _full(t: Tensor | None) -> Tensor | None:
    """The whole tensor of a ``DTensor`` (a collective: every rank must call it), else ``t``."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _ema_muon_group(opt, group) -> bool:
    """Whether ``group`` orthogonalizes an EMA momentum kept in ``state["momentum_buffer"]``."""
    if isinstance(opt, HybridOrthogonalOptimizer):
        return bool(group["use_muon"])
    muon = getattr(torch.optim, "Muon", None)
    return muon is not None and isinstance(opt, muon)


def pre_ns_matrices(grad: Tensor, buffer: Tensor, momentum: float, nesterov: bool,
                    layout: MatrixLayout) -> list[Tensor]:
    """``M̃`` from the gradient and the *updated* EMA buffer (both in the stored layout), as
    float64 copies of the layout's blocks, in the order of ``layout.blocks``."""
    m_tilde = grad.lerp(buffer, momentum) if nesterov else buffer
    return [block.detach().to(torch.float64, copy=True)
            for block in layout.matrices(m_tilde.detach())]


class SpectralMonitor(pl.Callback):
    """Log the spectral geometry Newton–Schulz sees, at fixed fractions of training.

    Args:
        modules: glob patterns (``fnmatch``) on module names of the LightningModule, e.g.
            ``["model.layers.[0-3].attn.*", "*.mlp.down_proj"]`` or ``["*conv*"]``; every ≥2-D
            parameter registered on a matching module (``weight``; an expert bank's
            ``gate_up_proj`` and ``down_proj``; ``in_proj_weight``) is measured if it sits in a
            Muon (matrix) param group, block by block as the optimizer sees it.
        fractions: fractions of the total optimizer steps (``trainer.max_steps``, else
            ``trainer.estimated_stepping_batches``) at which to measure; a fraction ``f`` fires
            at the first step ``s`` with ``s ≥ f·total``.
        steps: explicit optimizer steps (1-based: step ``s`` = after the ``s``-th update)
            instead of ``fractions``.
        modes: normalizations to compare (default none, R, C, RC).
        ns_steps, ns_coefficients: Newton–Schulz steps K and coefficients; default: the
            param group's own (``ns_steps``/``ns_coefficients``), else 5 and ``"quintic"``.
        ns_dtype: dtype of the measured NS iteration (default float64, as Theorem 3.1; use
            the optimizer's, e.g. ``"bfloat16"``, to include its rounding).
        eps: DiagPre's ``ε`` (default 1e-8, the paper's).
        rtol: rank tolerance of the SVD metrics (see :mod:`muoneq.diagnostics.metrics`).
        csv_name: CSV file written in ``trainer.log_dir``.
        log_figures: also log a plot in the style of the paper's Figure 2 per measured step to
            TensorBoard.
    """

    def __init__(
        self,
        modules: Sequence[str] = ("*",),
        fractions: Sequence[float] = (0.01, 0.1, 0.5, 1.0),
        steps: Sequence[int] | None = None,
        modes: Sequence[str] = MODES,
        ns_steps: int | None = None,
        ns_coefficients=None,
        ns_dtype: str | torch.dtype = "float64",
        eps: float = 1e-8,
        rtol: float | None = None,
        csv_name: str = "spectra.csv",
        log_figures: bool = True,
    ):
        super().__init__()
        if isinstance(modules, str) or not modules:
            raise ValueError(
                f"modules: expected a non-empty list of name patterns, got {modules!r}"
            )
        if steps is None:
            if not fractions or any(not 0 < float(f) <= 1 for f in fractions):
                raise ValueError(f"fractions: expected numbers in (0, 1], got {fractions!r}")
        elif not steps or any(isinstance(s, bool) or int(s) != s or s < 1 for s in steps):
            raise ValueError(f"steps: expected optimizer steps ≥ 1, got {steps!r}")
        if ns_steps is not None and (isinstance(ns_steps, bool) or int(ns_steps) != ns_steps
                                     or ns_steps < 0):
            raise ValueError(f"ns_steps: expected an integer ≥ 0, got {ns_steps!r}")
        if ns_coefficients is not None:
            normalize_coefficients(ns_coefficients, 5 if ns_steps is None else ns_steps)
        if not eps >= 0:
            raise ValueError(f"eps: expected a number ≥ 0, got {eps!r}")
        self.modules = tuple(modules)
        self.fractions = tuple(float(f) for f in fractions)
        self.steps = None if steps is None else tuple(int(s) for s in steps)
        self.modes = tuple(dict.fromkeys(canonical_mode(m) for m in modes))
        self.ns_steps = ns_steps
        self.ns_coefficients = ns_coefficients
        self.ns_dtype = resolve_dtype(ns_dtype)
        self.eps = eps
        self.rtol = rtol
        self.csv_name = csv_name
        self.log_figures = log_figures
        self.target_steps: frozenset[int] = frozenset()
        self.total_steps = 0
        self.csv_path: Path | None = None
        self._selected: list[Watched] = []
        self._last_step = -1

    # ------------------------------------------------------------------ set-up
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.total_steps = self._total_steps(trainer)
        self.target_steps = self.resolve_steps(self.total_steps)
        self._selected = self._select(trainer, pl_module)
        self._last_step = trainer.global_step
        log_dir = trainer.log_dir  # a broadcast: every rank must ask
        self.csv_path = Path(log_dir or trainer.default_root_dir) / self.csv_name
        if trainer.is_global_zero:
            self._prepare_csv(trainer.global_step)

    def resolve_steps(self, total_steps: int) -> frozenset[int]:
        """The optimizer steps that measure: ``steps``, or for each fraction ``f`` the first step
        ``s ≥ f·total_steps`` (1%, 10%, 50%, 100% of 1000 steps: 10, 100, 500, 1000)."""
        if self.steps is not None:
            return frozenset(self.steps)
        return frozenset(max(1, math.ceil(f * total_steps - 1e-9)) for f in self.fractions)

    @staticmethod
    def _total_steps(trainer: pl.Trainer) -> int:
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError(
                "SpectralMonitor: the length of training is unknown (no max_steps, infinite "
                "max_epochs); set trainer.max_steps or pass explicit steps=[...]"
            )
        return int(total)

    def _select(self, trainer, pl_module) -> list[Watched]:
        owner = {}
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    owner[p] = (opt, group)
        selected, skipped, names, seen = [], [], [], set()
        for name, module in pl_module.named_modules():
            matrices = [(pname, p) for pname, p in module.named_parameters(recurse=False)
                        if p.ndim >= 2 and id(p) not in seen]
            if not matrices:
                continue
            names.append(name)
            if not any(fnmatch.fnmatchcase(name, pat) for pat in self.modules):
                continue
            for pname, p in matrices:
                label = name if pname == "weight" else f"{name}.{pname}".lstrip(".")
                opt, group = owner.get(p, (None, None))
                if not _ema_muon_group(opt, group):
                    skipped.append(label)
                    continue
                seen.add(id(p))
                layout = (MatrixLayout.of(p, group) if isinstance(opt, HybridOrthogonalOptimizer)
                          else MatrixLayout(tuple(p.shape)))  # torch.optim.Muon: 2-D, plain
                selected.append(Watched(label, p, opt, group, layout))
        if not selected:
            hint = f"; matching weights outside Muon groups: {skipped[:8]}" if skipped else ""
            raise ValueError(
                f"SpectralMonitor.modules: {list(self.modules)} selects no matrix weight in a Muon "
                f"param group{hint}; module names with a ≥2-D weight include {names[:12]}"
            )
        return selected

    def _prepare_csv(self, global_step: int) -> None:
        """Keep rows up to the step we resume from (a restart re-measures later steps)."""
        assert self.csv_path is not None
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if self.csv_path.exists():
            with self.csv_path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= global_step]
        # atomic: a kill never loses the rows kept
        with atomic_open(self.csv_path, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._fields(), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def _fields(self) -> list[str]:
        k_max = max(self._ns_steps(w.group) for w in self._selected)
        return ["step", "fraction", "module", "block", "m", "n", "mode", *METRICS,
                *(f"rel_error_{k}" for k in range(k_max + 1))]

    def _ns_steps(self, group: dict) -> int:
        return self.ns_steps if self.ns_steps is not None else int(group.get("ns_steps", 5))

    # ------------------------------------------------------------------ measuring
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step this batch
            return
        self._last_step = step
        if step in self.target_steps:
            self.measure(trainer, step)

    @torch.no_grad()
    def measure(self, trainer: pl.Trainer, step: int) -> list[dict]:
        """Measure every selected weight now; return the rows written (empty off rank 0)."""
        rows, curves = [], defaultdict(list)
        for w in self._selected:
            grad = _full(w.param.grad)
            buffer = _full(w.optimizer.state.get(w.param, {}).get("momentum_buffer"))
            if not trainer.is_global_zero or grad is None or buffer is None:
                continue
            group = w.group
            blocks = pre_ns_matrices(grad, buffer, group["momentum"],
                                     group.get("nesterov", False), w.layout)
            K = self._ns_steps(group)
            coefficients = self.ns_coefficients or group.get("ns_coefficients", "quintic")
            for block, m_tilde in enumerate(blocks):
                results = error_decomposition(
                    m_tilde, self.modes, K, coefficients, self.ns_dtype, self.eps, self.rtol
                )
                for mode, d in results.items():
                    rows.append(self._row(step, w, block, m_tilde.shape, d))
                    curves[mode].append(list(d.relative_curve))
        if rows:
            self._write(trainer, step, rows, curves)
        return rows

    def _row(self, step: int, w: Watched, block: int, shape, d: ModeDiagnostics) -> dict:
        row = {
            "step": step, "fraction": round(step / self.total_steps, 6), "module": w.label,
            "block": block, "tag": w.tag(block),
            "m": shape[0], "n": shape[1], "mode": d.mode, "rank": d.rank,
            "stable_rank": d.stable_rank, "condition_number": d.condition_number,
            "entropy": d.entropy, "ns_error": d.finite_step_error,
            "ns_rel_error": d.relative_error, "bias": d.bias, "total_error": d.total_error,
        }
        row.update({f"rel_error_{k}": e for k, e in enumerate(d.relative_curve)})
        return row

    def _write(self, trainer: pl.Trainer, step: int, rows: list[dict], curves: dict) -> None:
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._fields(), extrasaction="ignore").writerows(rows)
        writers = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not writers:
            return
        for writer in writers:
            for r in rows:
                for metric in METRICS:
                    writer.add_scalar(f"spectra/{r['tag']}/{r['mode']}/{metric}", r[metric],
                                      step)
        if self.log_figures and len({len(c) for cs in curves.values() for c in cs}) == 1:
            from muoneq.suite.spectra.figures import training_curves

            fig = training_curves(
                dict(curves), f"step {step} ({100 * step / self.total_steps:.0f}% of training), "
                f"{sum(len(w.layout.blocks) for w in self._selected)} matrices")
            for writer in writers:
                writer.add_figure("spectra/ns_error_curves", fig, step)
