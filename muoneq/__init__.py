"""MuonEq: balancing before orthogonalization with lightweight equilibration.

Public API::

    from muoneq import MuonEq, param_groups, build_optimizer
    opt = MuonEq(param_groups(model, lr=2e-3), mode="R")

Algorithm 1 as functions (one matrix at a time): :mod:`muoneq.functional`.
"""

from muoneq.functional import MODES, canonical_mode, diag_pre, muoneq_update
from muoneq.newton_schulz import newton_schulz
from muoneq.optim import (
    AdaMuon,
    HybridOrthogonalOptimizer,
    MarsAdamW,
    Mousse,
    MuonEq,
    MuonPlus,
    NorMuon,
)
from muoneq.registry import OPTIMIZERS, build_optimizer, register_optimizer
from muoneq.routing import describe_groups, describe_routing, param_groups

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "OPTIMIZERS",
    "AdaMuon",
    "HybridOrthogonalOptimizer",
    "MarsAdamW",
    "Mousse",
    "MuonEq",
    "MuonPlus",
    "NorMuon",
    "build_optimizer",
    "canonical_mode",
    "describe_groups",
    "describe_routing",
    "diag_pre",
    "muoneq_update",
    "newton_schulz",
    "param_groups",
    "register_optimizer",
]
