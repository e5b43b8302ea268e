"""Optimizers: MuonEq, the shared hybrid machinery and the paper's baselines."""

from muoneq.optim.adamuon import AdaMuon
from muoneq.optim.base import signature
from muoneq.optim.hybrid import HybridOrthogonalOptimizer
from muoneq.optim.mars_adamw import MarsAdamW
from muoneq.optim.mousse import Mousse
from muoneq.optim.muon_plus import MuonPlus
from muoneq.optim.muoneq import MuonEq
from muoneq.optim.normuon import NorMuon

__all__ = [
    "AdaMuon",
    "HybridOrthogonalOptimizer",
    "MarsAdamW",
    "Mousse",
    "MuonEq",
    "MuonPlus",
    "NorMuon",
    "signature",
]
