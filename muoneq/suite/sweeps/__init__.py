"""Sweeps: Optuna studies over trial processes (``muoneq sweep sweeps/<name>.yaml``).

The sweep file (:mod:`~muoneq.suite.sweeps.spec`, its ``report:`` section
:mod:`~muoneq.suite.sweeps.report_spec`, checked by :mod:`~muoneq.suite.sweeps.validate`), the study
and its storage (:mod:`~muoneq.suite.sweeps.study`, :mod:`~muoneq.suite.sweeps.storage`), each axis'
Optuna distribution (:mod:`~muoneq.suite.sweeps.distributions`), what a trial's user attributes hold
(:mod:`~muoneq.suite.sweeps.trial_record`), what each run holds
(:mod:`~muoneq.suite.sweeps.ledger`), typed jobs (:mod:`~muoneq.suite.sweeps.scheduler`), trial
processes (:mod:`~muoneq.suite.sweeps.runner`, :mod:`~muoneq.suite.sweeps.launch`), their
``metrics.json`` as Optuna's state and value (:mod:`~muoneq.suite.sweeps.verdict`), TensorBoard's
HParams view (:mod:`~muoneq.suite.sweeps.hparams`) and the workers
(:mod:`~muoneq.suite.sweeps.driver`).

Public API::

    from muoneq.suite.sweeps import load_sweep, Driver, DriverOptions
    spec = load_sweep("sweeps/ablation-cifar10.yaml", ["seeds=[0]"])
    summary = Driver(spec, DriverOptions(workers=4)).run()

The names are imported when first used (:pep:`562`): a warm trial's server imports
:mod:`~muoneq.suite.sweeps.warm` from this package, and with it nothing of the sweep (Optuna,
SQLAlchemy, OmegaConf), which every trial it forks would inherit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from muoneq.suite.sweeps.driver import Driver, DriverOptions
    from muoneq.suite.sweeps.ledger import Summary
    from muoneq.suite.sweeps.spec import Point, SweepError, SweepSpec, load_sweep

#: each public name, by the module that defines it
_MODULES = {"Driver": "driver", "DriverOptions": "driver", "Summary": "ledger", "Point": "spec",
            "SweepError": "spec", "SweepSpec": "spec", "load_sweep": "spec"}

__all__ = ["Driver", "DriverOptions", "Point", "Summary", "SweepError", "SweepSpec", "load_sweep"]


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
