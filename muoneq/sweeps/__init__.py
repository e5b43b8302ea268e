"""Sweeps: Optuna studies over trial processes (``muoneq sweep sweeps/<name>.yaml``).

The sweep file (:mod:`~muoneq.sweeps.spec`, its ``report:`` section
:mod:`~muoneq.sweeps.report_spec`, checked by :mod:`~muoneq.sweeps.validate`), the study and its
storage (:mod:`~muoneq.sweeps.study`, :mod:`~muoneq.sweeps.storage`), each axis' Optuna
distribution (:mod:`~muoneq.sweeps.distributions`), what a trial's user attributes hold
(:mod:`~muoneq.sweeps.trial_record`), what each run holds (:mod:`~muoneq.sweeps.ledger`), typed
jobs (:mod:`~muoneq.sweeps.scheduler`), trial processes (:mod:`~muoneq.sweeps.runner`,
:mod:`~muoneq.sweeps.launch`), their ``metrics.json`` as Optuna's state and value
(:mod:`~muoneq.sweeps.verdict`), TensorBoard's HParams view (:mod:`~muoneq.sweeps.hparams`) and
the workers (:mod:`~muoneq.sweeps.driver`).

Public API::

    from muoneq.sweeps import load_sweep, Driver, DriverOptions
    spec = load_sweep("sweeps/ablation-cifar10.yaml", ["seeds=[0]"])
    summary = Driver(spec, DriverOptions(workers=4)).run()
"""

from muoneq.sweeps.driver import Driver, DriverOptions
from muoneq.sweeps.ledger import Summary
from muoneq.sweeps.spec import Point, SweepError, SweepSpec, load_sweep

__all__ = ["Driver", "DriverOptions", "Point", "Summary", "SweepError", "SweepSpec", "load_sweep"]
