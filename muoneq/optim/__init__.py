"""Optimizers: MuonEq, the shared hybrid machinery and the paper's baselines."""

from muoneq.optim.hybrid import HybridOrthogonalOptimizer, lr_scale, matrix_shape
from muoneq.optim.muoneq import MuonEq

__all__ = ["HybridOrthogonalOptimizer", "MuonEq", "lr_scale", "matrix_shape"]
