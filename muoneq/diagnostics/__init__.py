"""Spectral diagnostics: the geometry finite-step Newton–Schulz sees (paper Section 3), torch only.

* :mod:`~muoneq.diagnostics.metrics` – stable rank, condition numbers ``κ``/``κ_i`` (with a rank
  tolerance), singular-value entropy, the exact polar factor (float64 SVD).
* :mod:`~muoneq.diagnostics.ns_error` – eq. (5) (finite-step error and
  preconditioning bias for none/R/C/RC), error curves over NS steps, Theorem 3.1's bound.

The Lightning callback that measures them during training (``SpectralMonitor``) and the synthetic
study of the paper's Figure 1 (``muoneq spectra``) are the suite's: :mod:`muoneq.suite.spectra`.
"""

from muoneq.diagnostics.metrics import (
    Spectrum,
    condition_number,
    kappa_i,
    polar_factor,
    singular_value_entropy,
    spectrum,
    stable_rank,
    svd_polar,
)
from muoneq.diagnostics.ns_error import (
    ModeDiagnostics,
    error_decomposition,
    ns_lower_bound,
    theorem_applies,
)

__all__ = [
    "ModeDiagnostics",
    "Spectrum",
    "condition_number",
    "error_decomposition",
    "kappa_i",
    "ns_lower_bound",
    "polar_factor",
    "singular_value_entropy",
    "spectrum",
    "stable_rank",
    "svd_polar",
    "theorem_applies",
]
