"""What a table's timings were measured on, and whether the machine was busy.

Each run records its device, torch's CPU threads, the machine's cores and its 1-minute load
average at the timed steps (:class:`muoneq.suite.runtime.callbacks.StepStats`). A load above the
cores means other processes shared them: step times then measure the machine as much as the
optimizer, while the losses do not change. Under a table with a timing column the report says
what the runs ran on and, when the load exceeded the cores by more than :data:`BUSY_MARGIN`
during a run, that the machine was busy.
"""

from __future__ import annotations

from collections.abc import Sequence

from muoneq.suite.runtime.metrics import TIMING_KEYS

#: the share of the cores a load may exceed them by before the machine counts as busy: a sweep
#: whose trials fill the cores (the demo: 2 one-thread trials on 2 cores) has a load of the
#: cores plus its driver's few hundredths, and a slowdown under 10 % is within what the paired
#: step times of these machines resolve
BUSY_MARGIN = 0.10


def is_busy(load: float, cores: int) -> bool:
    """Whether a 1-minute ``load`` on ``cores`` cores exceeds them by more than
    :data:`BUSY_MARGIN`."""
    return load > cores * (1 + BUSY_MARGIN)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _listed(values) -> str:
    found = sorted({v for v in values if v is not None}, key=str)
    return ", ".join(map(str, found)) or "?"


def timing_note(runs: Sequence[dict], metrics: Sequence[str]) -> str:
    """A paragraph on the machine behind the timing ``metrics`` of ``runs`` (empty when the
    table times nothing)."""
    timed = [m for m in metrics if m in TIMING_KEYS]
    if not timed or not runs:
        return ""
    what = ", ".join(timed)
    recorded = [r for r in runs if _number(r.get("load_avg")) and _number(r.get("cores"))]
    if not recorded:
        return (f"\n{what}: the runs did not record the machine's load (made by an earlier "
                "muoneq), so whether it was busy is not known.\n")
    loads = [r["load_avg"] for r in recorded]
    text = (f"\n{what} measured on {_listed(r.get('device') for r in runs)}, "
            f"{_listed(r.get('threads') for r in runs)} CPU thread(s) per run, "
            f"{_listed(r.get('cores') for r in runs)} cores; the machine's 1-minute load "
            f"average at the timed steps was {min(loads):.1f} to {max(loads):.1f} (mean per "
            "run)")
    busy = [r for r in recorded if is_busy(r["load_avg"], r["cores"])]
    if busy:
        text += (f". **The machine was busy** (a load over {BUSY_MARGIN:.0%} above its cores) "
                 f"during {len(busy)} of {len(recorded)} runs: a difference in {what} may be the "
                 "load's, not the optimizers'; measure again on an idle machine")
    return text + ".\n"
