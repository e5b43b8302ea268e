"""A sweep's study in miniature: ``muoneq sweep NAME --mini`` (``make NAME MINI=1``).

The sweep file's ``mini:`` section (:class:`muoneq.suite.sweeps.spec.Mini`) gives what changes:
a tiny model's experiment on a CPU in float32 (``conf/experiment/mini_*.yaml``), fewer values
on the same axes, fewer seeds, and a bound on bracketing; the study is ``<study>-mini``, its
objective and ``report:`` section the sweep's (:func:`muoneq.suite.sweeps.spec.miniature`).
Its data is a small *real* data set available offline, which the task prepares into
``<study>/data/`` before anything runs (its ``mini_data``: Python's pydoc topics as bytes for
the language tasks, scikit-learn's handwritten digits in CIFAR-10's format for the CIFAR-10
task); the overrides that read it join the study's, and its name the study's description, which
the report prints.
"""

from __future__ import annotations

from pathlib import Path

from muoneq.suite.runtime.tasks import MiniData
from muoneq.suite.sweeps.spec import SweepError, SweepSpec

DATA_DIR = "data"


def prepare(spec: SweepSpec, study_dir: Path) -> MiniData:
    """Prepare the data of the miniature ``spec`` in ``<study_dir>/data`` (once: a task skips
    what is there) and point its runs at it (``spec.overrides``, ``spec.description``)."""
    from muoneq.suite.errors import UserError
    from muoneq.suite.runtime.config import compose
    from muoneq.suite.runtime.tasks import get_task
    from muoneq.suite.sweeps.validate import search_points

    point = spec.points()[0] if spec.is_grid else next(iter(search_points(spec)))
    try:
        cfg = compose([f"experiment={spec.experiment_of(point)}", *spec.overrides,
                       *point.overrides()])
    except UserError as err:
        raise SweepError(f"{spec.study}: its first point is not a valid training config: "
                         f"{err}") from None
    task = get_task(cfg.task.name)
    if task.mini_data is None:
        raise SweepError(f"{spec.study}: task {cfg.task.name!r} prepares no data for a "
                         "miniature (its TaskSpec has no mini_data)")
    data = task.mini_data(Path(study_dir) / DATA_DIR)
    spec.overrides = [*spec.overrides, *data.overrides]
    spec.description = f"{spec.description} Data: {data.description}."
    return data
