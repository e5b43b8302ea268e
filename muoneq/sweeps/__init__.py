"""Sweeps: Optuna studies over trial processes (``muoneq sweep sweeps/<name>.yaml``).

Public API::

    from muoneq.sweeps import load_sweep, Driver, DriverOptions
    spec = load_sweep("sweeps/ablation-cifar10.yaml", ["seeds=[0]"])
    summary = Driver(spec, DriverOptions(workers=4)).run()
"""

from muoneq.sweeps.driver import Driver, DriverOptions, Summary
from muoneq.sweeps.spec import Point, SweepError, SweepSpec, load_sweep

__all__ = ["Driver", "DriverOptions", "Point", "Summary", "SweepError", "SweepSpec", "load_sweep"]
