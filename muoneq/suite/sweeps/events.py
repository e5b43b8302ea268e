"""Read scalars from the TensorBoard event files a trial writes under its run folder.

Used by the driver (intermediate values for pruning, by global step) and by the reports
(learning curves). Runs may hold several event files (a resumed run adds one); points are merged
by step, later files winning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

EVENT_GLOB = "events.out.tfevents.*"
#: the folder of the study's HParams experiment config (:mod:`muoneq.suite.sweeps.hparams`), and
#: of each run's session in studies made by earlier versions: no learning curve
HPARAMS_DIR = "hparams"
#: the end of the name of a run's HParams session file, beside its curves in its TensorBoard
#: folder (one TensorBoard run per run folder): no learning curve either
SESSION_SUFFIX = ".hparams"

# The directory watcher logs "No path found after …" at INFO on every reload of a live run.
logging.getLogger("tensorboard").setLevel(logging.WARNING)


def is_curve(event_file: Path) -> bool:
    """Whether an event file holds learning curves (not an HParams session or config)."""
    return event_file.parent.name != HPARAMS_DIR and not event_file.name.endswith(SESSION_SUFFIX)


class ScalarReader:
    """Incremental reader of every event file of curves under ``root`` (new files are picked
    up; HParams sessions are not curves: :func:`is_curve`)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._accumulators: dict[Path, EventAccumulator] = {}

    def _refresh(self) -> list[EventAccumulator]:
        if self.root.is_dir():
            for event_file in sorted(self.root.rglob(EVENT_GLOB)):
                if is_curve(event_file) and event_file not in self._accumulators:
                    self._accumulators[event_file] = EventAccumulator(
                        str(event_file), size_guidance={SCALARS: 0}
                    )
        for acc in self._accumulators.values():
            acc.Reload()
        return [self._accumulators[k] for k in sorted(self._accumulators)]

    def tags(self) -> list[str]:
        found: set[str] = set()
        for acc in self._refresh():
            found.update(acc.Tags().get("scalars", []))
        return sorted(found)

    def scalars(self, tag: str) -> dict[int, float]:
        """``{global step: value}`` of ``tag`` over all event folders (empty if absent)."""
        out: dict[int, float] = {}
        for acc in self._refresh():
            if tag in acc.Tags().get("scalars", []):
                for event in acc.Scalars(tag):
                    out[int(event.step)] = float(event.value)
        return dict(sorted(out.items()))
