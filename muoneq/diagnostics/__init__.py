"""Spectral diagnostics: the geometry finite-step Newton–Schulz sees (paper Section 3).

* :mod:`~muoneq.diagnostics.metrics` – stable rank, condition numbers ``κ``/``κ_i`` (with a rank
  tolerance), singular-value entropy, the exact polar factor (float64 SVD).
* :mod:`~muoneq.diagnostics.ns_error` – eq. (5) (finite-step error and
  preconditioning bias for none/R/C/RC), error curves over NS steps, Theorem 3.1's bound.
* :mod:`~muoneq.diagnostics.ns_geometry_study` – the synthetic study of the paper's Figure 1
  (``muoneq spectra``).
* :mod:`~muoneq.diagnostics.callback` – :class:`SpectralMonitor`, a Lightning callback that
  measures the pre-NS momentum during training (the paper's Figures 2, 6 and 7).
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
    "SpectralMonitor",
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


def __getattr__(name: str):
    # The callback pulls in Lightning; import it only when asked for (PEP 562).
    if name == "SpectralMonitor":
        from muoneq.diagnostics.callback import SpectralMonitor

        return SpectralMonitor
    raise AttributeError(f"module 'muoneq.diagnostics' has no attribute {name!r}")
