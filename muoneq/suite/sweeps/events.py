"""Read scalars from the TensorBoard event files a trial writes under its run folder.

Used by the driver (intermediate values for pruning, by global step) and by the reports
(learning curves). Runs may hold several event folders (a resumed run adds a version); points
are merged by step, later files winning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

EVENT_GLOB = "events.out.tfevents.*"
#: the folder of the HParams summaries (:mod:`muoneq.suite.sweeps.hparams`), under the study folder
#: and under each run folder: a run's session there is no learning curve
HPARAMS_DIR = "hparams"

# The directory watcher logs "No path found after …" at INFO on every reload of a live run.
logging.getLogger("tensorboard").setLevel(logging.WARNING)


class ScalarReader:
    """Incremental reader of every event folder under ``root`` (new folders are picked up)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._accumulators: dict[Path, EventAccumulator] = {}

    def _refresh(self) -> list[EventAccumulator]:
        if self.root.is_dir():
            for event_file in sorted(self.root.rglob(EVENT_GLOB)):
                folder = event_file.parent
                if folder.name == HPARAMS_DIR:  # a run's HParams session, not its curves
                    continue
                if folder not in self._accumulators:
                    self._accumulators[folder] = EventAccumulator(
                        str(folder), size_guidance={SCALARS: 0}
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
