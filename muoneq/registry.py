"""Build any optimizer of the paper by name: ``build_optimizer("muoneq_nes", model, lr=2e-3)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from muoneq.optim.adamuon import AdaMuon
from muoneq.optim.hybrid import HybridOrthogonalOptimizer
from muoneq.optim.mars_adamw import MarsAdamW
from muoneq.optim.mousse import Mousse
from muoneq.optim.muon_plus import MuonPlus
from muoneq.optim.muoneq import MuonEq
from muoneq.optim.normuon import NorMuon
from muoneq.routing import param_groups


@dataclass(frozen=True)
class OptimizerSpec:
    """How a name is built: the class, the preset hyper-parameters, and what it is.

    ``label`` is how reports and the paper name it (the registry name if empty);
    ``counterpart`` is the registered optimizer it is a variant of, which reports compare it
    with (MuonEq-Nes with Muon-Nes), or ``None``.
    """

    factory: Callable[..., torch.optim.Optimizer]
    preset: dict = field(default_factory=dict)
    description: str = ""
    label: str = ""
    counterpart: str | None = None

    @property
    def hybrid(self) -> bool:
        factory = self.factory
        return isinstance(factory, type) and issubclass(factory, HybridOrthogonalOptimizer)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "sgd": OptimizerSpec(torch.optim.SGD, {}, "torch.optim.SGD", label="SGD"),
    "adamw": OptimizerSpec(torch.optim.AdamW, {}, "torch.optim.AdamW", label="AdamW"),
    "muon": OptimizerSpec(
        MuonEq, {"mode": "none", "nesterov": False}, "Muon: NS5 of the EMA momentum",
        label="Muon",
    ),
    "muon_nes": OptimizerSpec(
        MuonEq, {"mode": "none", "nesterov": True}, "Muon with the Nesterov input",
        label="Muon-Nes",
    ),
    "muoneq": OptimizerSpec(
        MuonEq, {"mode": "R", "nesterov": False}, "MuonEq (R): row equilibration, then NS5",
        label="MuonEq", counterpart="muon",
    ),
    "muoneq_nes": OptimizerSpec(
        MuonEq, {"mode": "R", "nesterov": True}, "MuonEq-Nes (R by default; mode= RC / C)",
        label="MuonEq-Nes", counterpart="muon_nes",
    ),
    "mars_adamw": OptimizerSpec(
        MarsAdamW, {"gamma": 0.025}, "MARS-AdamW: AdamW on the variance-reduced gradient",
        label="MARS-AdamW",
    ),
    "adamuon": OptimizerSpec(
        AdaMuon, {}, "AdaMuon: NS of sign(momentum), element-wise second moment, RMS 0.2",
        label="AdaMuon",
    ),
    "muon_plus": OptimizerSpec(
        MuonPlus, {"norm_mode": "col_row"}, "Muon+: NS5, then column and row normalization",
        label="Muon+",
    ),
    "normuon": OptimizerSpec(
        NorMuon, {}, "NorMuon: NS5, then per-row second-moment normalization",
        label="NorMuon",
    ),
    "mousse": OptimizerSpec(
        Mousse, {}, "Mousse: NS5 in Kronecker-whitened coordinates (eigenbases every 10 steps)",
        label="Mousse",
    ),
}


def register_optimizer(name: str, spec: OptimizerSpec) -> None:
    """Add an optimizer to :func:`build_optimizer` (for extensions of the suite)."""
    if name in OPTIMIZERS:
        raise ValueError(f"optimizer name {name!r} is already registered")
    if spec.counterpart is not None and spec.counterpart not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: counterpart {spec.counterpart!r} is not "
                         f"registered; known: {', '.join(sorted(OPTIMIZERS))}")
    OPTIMIZERS[name] = spec


def optimizer_label(name: str) -> str:
    """How reports name optimizer ``name``: its registry label, else the name itself."""
    spec = OPTIMIZERS.get(name)
    return spec.label if spec is not None and spec.label else name


def counterpart_of(name: str | None) -> str | None:
    """The optimizer that ``name`` is a variant of (``muoneq_nes`` → ``muon_nes``), or None."""
    spec = OPTIMIZERS.get(name) if name is not None else None
    return None if spec is None else spec.counterpart


def build_optimizer(
    name: str, model_or_groups: nn.Module | Iterable, **hparams
) -> torch.optim.Optimizer:
    """Build the optimizer called ``name`` over a model or explicit params/param groups.

    With an ``nn.Module``, orthogonalized (hybrid) optimizers route its parameters with
    :func:`muoneq.param_groups` (hidden matrices to the matrix path, embeddings, head,
    first conv and 1-D tensors to AdamW); element-wise optimizers take all parameters.
    ``hparams`` override the preset of the name (e.g. ``mode="RC"`` for ``muoneq_nes``).
    """
    key = name.lower()
    if key not in OPTIMIZERS:
        known = ", ".join(sorted(OPTIMIZERS))
        raise ValueError(f"optimizer: unknown name {name!r}; known: {known}")
    spec = OPTIMIZERS[key]
    if isinstance(model_or_groups, nn.Module):
        params = param_groups(model_or_groups) if spec.hybrid else model_or_groups.parameters()
    else:
        params = model_or_groups
    return spec.factory(params, **{**spec.preset, **hparams})
