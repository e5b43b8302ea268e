"""The experiment suite: everything ``pip install "muoneq[suite]"`` adds to the library.

* :mod:`~muoneq.suite.cli` – the ``muoneq`` command, one sub-command per job;
* :mod:`~muoneq.suite.runtime` – configs composed from ``conf/``, the Lightning trainer, the base
  classes of a workload (``muoneq train``);
* :mod:`~muoneq.suite.sweeps` – Optuna studies of trial processes (``muoneq sweep``);
* :mod:`~muoneq.suite.report` – tables, heatmaps and confidence intervals (``muoneq report``);
* :mod:`~muoneq.suite.spectra` – the Lightning and matplotlib half of the spectral diagnostics
  (``SpectralMonitor``, ``muoneq spectra``);
* :mod:`~muoneq.suite.benchmarks` – ``muoneq bench`` and ``muoneq gpu-check``;
* :mod:`~muoneq.suite.demo` – ``make demo``.

The suite imports the library (:mod:`muoneq` and its torch-only modules); the library never
imports the suite (``tests/test_packaging.py`` checks every import statement). The workloads
themselves are the package :mod:`muoneq_tasks` (the repository's ``tasks/`` folder).
"""
