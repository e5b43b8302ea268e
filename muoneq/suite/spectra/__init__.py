"""The suite's half of the spectral diagnostics: what needs Lightning or matplotlib.

* :mod:`~muoneq.suite.spectra.monitor` – :class:`SpectralMonitor`, a Lightning callback that
  measures the pre-NS momentum during training (the paper's Figures 2, 6 and 7);
* :mod:`~muoneq.suite.spectra.ns_geometry_study` – the synthetic study of the paper's Figure 1
  (``muoneq spectra``, :mod:`~muoneq.suite.spectra.cli`);
* :mod:`~muoneq.suite.spectra.figures` – their matplotlib figures.

The measurements themselves (stable rank, ``κ``, eq. (5)) are the library's
:mod:`muoneq.diagnostics`, torch only.
"""

from muoneq.suite.spectra.monitor import SpectralMonitor

__all__ = ["SpectralMonitor"]
