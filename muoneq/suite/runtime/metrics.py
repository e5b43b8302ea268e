"""``metrics.json``: the figures a finished run writes as its last act, and the keys it holds.

The file is the contract between a run and whatever reads its result (a sweep's objective,
the report's tables). :func:`metric_keys` lists, from a composed config and without training,
the keys a run of it writes: the runtime's own (:data:`RUN_KEYS`, :data:`STEP_STATS_KEYS`) and
those its task declares (:attr:`muoneq.suite.runtime.tasks.TaskSpec.metrics`), so that a sweep can
refuse a misspelled objective, or one that is text (:data:`TEXT_KEYS`) or not measured on this
machine (MFU on a CPU), before any run starts.
"""

from __future__ import annotations

from typing import Any

METRICS_FILE = "metrics.json"
#: set to ``0`` in a run's environment, the run declares no TensorBoard HParams session of its
#: own: a sweep writes its study's (:mod:`muoneq.suite.sweeps.hparams`), one row per run
HPARAMS_ENV = "MUONEQ_RUN_HPARAMS"
#: the run folder's TensorBoard events (its scalars by global step; a sweep adds the run's
#: HParams session there, one TensorBoard run per run folder)
TENSORBOARD_DIR = "tensorboard"

#: keys :func:`muoneq.suite.runtime.run.train` writes for every task
RUN_KEYS = (
    "status", "task", "optimizer", "seed", "paper_metric", "monitor", "monitor_mode", "best",
    "final", "wall_clock_s", "global_step", "epochs", "world_size", "parameters", "run_dir",
    "muoneq_version", "git_commit",
)
#: the run summary of :class:`muoneq.suite.runtime.callbacks.StepStats`, and what it logs per step
STEP_STATS_KEYS = (
    "step_time_s", "step_time_median_s", "timed_steps", "peak_memory_gb", "peak_memory_kind",
    "train_seconds", "device", "threads", "cores", "load_avg", "load_max",
)
STEP_LOG_KEYS = ("perf/step_time_s", "perf/peak_memory_gb")
#: the keys above that hold text (a commit, a name, a path), not a number: never an objective
TEXT_KEYS = ("status", "task", "optimizer", "paper_metric", "monitor", "monitor_mode", "run_dir",
             "muoneq_version", "git_commit", "peak_memory_kind", "device")
#: the keys that time a run (their comparisons depend on the machine's load:
#: :mod:`muoneq.suite.report.machine`)
TIMING_KEYS = ("step_time_s", "step_time_median_s", "train_seconds", "wall_clock_s",
               "tokens_per_s", "perf/step_time_s", "perf/tokens_per_s")


def metric_keys(cfg: Any) -> list[str] | None:
    """The keys of the ``metrics.json`` a run of the composed config ``cfg`` writes on this
    machine with a value (sorted; :data:`TEXT_KEYS` hold text, the others numbers), or None
    when its task declares none (a third-party task without ``TaskSpec.metrics``)."""
    from muoneq.suite.runtime.tasks import get_task

    declared = get_task(cfg.task.name).metrics
    if declared is None:
        return None
    return sorted({*RUN_KEYS, *STEP_STATS_KEYS, *STEP_LOG_KEYS, *declared(cfg)})
