"""TensorBoard's HParams view of a study: its sensitivity view (table, parallel coordinates,
scatter plots) over the swept axes, with the study's own metrics.

``tensorboard --logdir runs/<study>/tensorboard`` finds

* one experiment config for the whole study, in ``<study>/hparams/`` (written by each driver
  when it starts): the swept axes (those of more than one value), plus the optimizer and
  MuonEq's mode, as hyper-parameters (constants, an axis of one value among them, are left out
  of the view: TensorBoard shows every declared one), and as
  metrics the objective and every metric the ``report:`` section names, under their own names
  (``val/ppl``, ``test/acc``, ``step_time_s``), the objective's description saying which way
  is better;
* one session per finished run, in its own event file (``*.hparams``) beside the run's curves
  in ``<run dir>/tensorboard/`` (written when its trial is told), so that each run is one
  TensorBoard run (named as the run is: by its short name in the study's view,
  :mod:`muoneq.suite.sweeps.tensorboard_view`): its point's values, its optimizer and mode as
  the run's ``config.yaml`` records them, grouped by its swept values (``lr=0.002
  momentum=0.95``: its seeds are one row, TensorBoard shows their mean), and the final
  value of each declared metric from its ``metrics.json`` as a scalar at the run's last global
  step. An integer axis (K) is declared as text, so that TensorBoard shows ``5``, not the
  ``5.0000`` it prints for every number. A session also holds its study's name, undeclared
  (:data:`STUDY_HPARAM`): TensorBoard shows one experiment config per view, so a view of
  several studies leaves theirs out and shows the hyper-parameters of every session, the
  study among them.

The training process writes no session of its own while a sweep runs it (the driver sets
:data:`muoneq.suite.runtime.metrics.HPARAMS_ENV`), so each run is one row. The HParams protocol
buffers are TensorBoard's own (``tensorboard.plugins.hparams``); TensorBoard's hparams
``summary`` module needs TensorFlow, so the three summaries are assembled here from its
``api_pb2`` / ``plugin_data_pb2`` messages and written with its ``EventFileWriter``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from muoneq.suite.runtime.metrics import TENSORBOARD_DIR
from muoneq.suite.sweeps.events import EVENT_GLOB, HPARAMS_DIR, SESSION_SUFFIX
from muoneq.suite.sweeps.report_spec import metrics_named
from muoneq.suite.sweeps.spec import Point, SweepSpec, format_value
from muoneq.suite.sweeps.tensorboard_view import label

#: settings shown beside the axes, read from a run's config.yaml: the optimizer and its mode
EXTRA = ("optimizer", "optimizer.mode")
#: every session's study, undeclared: a study's own view leaves it out, and a view of several
#: studies without their experiment configs (``make tensorboard`` without ``STUDY``), which
#: TensorBoard infers from the sessions, shows it as a column
STUDY_HPARAM = "study"


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> summary_pb2.Summary:
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=tag, metadata=metadata.create_summary_metadata(data))])


def _write(folder: Path, summaries: Iterable[summary_pb2.Summary], step: int = 0,
           suffix: str = "") -> None:
    """Replace the event files of ``folder`` whose names end with ``suffix`` with one holding
    ``summaries`` (the folder's other files are left alone)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(EVENT_GLOB + suffix):
        old.unlink()
    writer = EventFileWriter(str(folder), filename_suffix=suffix)
    for summary in summaries:
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    writer.close()


def declared_metrics(spec: SweepSpec) -> dict[str, str]:
    """The metrics of the HParams view, each with its description."""
    better = "lower" if spec.objective.direction == "minimize" else "higher"
    out = {spec.objective.metric: f"the study's objective ({better} is better)"}
    for metric, field in metrics_named(spec.report).items():
        out.setdefault(metric, f"named by {field}")
    return out


def axis_values(spec: SweepSpec) -> dict[str, list[Any]]:
    """The values each axis takes in the sweep file (an open search: its bounds or choices)."""
    from muoneq.suite.sweeps.distributions import axis_blocks

    if not spec.planned:
        return {n: list(p.choices) if p.type == "categorical" else [p.low, p.high]
                for n, p in spec.search.params.items()}
    return {a: list(dict.fromkeys(v for block in blocks for v in block))
            for a, blocks in axis_blocks(spec).items()}


def _type(values: Iterable[Any]) -> int:
    """Bool, float or (also for integers, and for no values: the optimizer, the mode) string:
    TensorBoard prints every number with five digits (K as ``5.0000``)."""
    values = list(values)
    if values and all(isinstance(v, bool) for v in values):
        return api_pb2.DATA_TYPE_BOOL
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return api_pb2.DATA_TYPE_STRING
    if values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return api_pb2.DATA_TYPE_FLOAT64
    return api_pb2.DATA_TYPE_STRING


def swept(spec: SweepSpec) -> list[str]:
    """The axes that take more than one value (the others are constants of the study)."""
    return [a for a, v in axis_values(spec).items() if len(v) > 1]


def declared_hparams(spec: SweepSpec) -> list[str]:
    """The hyper-parameters of the HParams view: the swept axes, the optimizer and its mode."""
    axes = swept(spec)
    return [*axes, *(name for name in EXTRA if name not in axes)]


def group_name(spec: SweepSpec, point: Point) -> str:
    """A run's row in the HParams table: its swept axes' values (``lr=0.002 mode=R``), short
    enough for the table's Trial ID column; its seeds share it."""
    axes = swept(spec)
    return " ".join(label(a, v, exact=True) for a, v in point.items if a in axes) or point.key


def write_experiment(spec: SweepSpec, study_dir: Path) -> None:
    """The study's experiment config (module docstring), in ``<study>/hparams/``."""
    values = axis_values(spec)
    infos = [api_pb2.HParamInfo(name=a, type=_type(values.get(a, ())),
                                differs=len(values.get(a, ())) > 1)
             for a in declared_hparams(spec)]
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m), display_name=m,
                                  description=text)
               for m, text in declared_metrics(spec).items()]
    experiment = api_pb2.Experiment(name=spec.study, description=spec.description,
                                    time_created_secs=time.time(), hparam_infos=infos,
                                    metric_infos=metrics)
    _write(Path(study_dir) / HPARAMS_DIR,
           [_summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(
               experiment=experiment))])


def _value(value: Any, kind: int):
    """An hparam value as the protocol buffer's ``Value`` of the declared type ``kind``."""
    from google.protobuf import struct_pb2

    if kind == api_pb2.DATA_TYPE_BOOL:
        return struct_pb2.Value(bool_value=value)
    if kind == api_pb2.DATA_TYPE_FLOAT64:
        return struct_pb2.Value(number_value=float(value))
    return struct_pb2.Value(string_value=value if isinstance(value, str) else
                            format_value(value))


#: the value of an optimizer or mode a run does not have (AdamW has no mode): TensorBoard's
#: parallel coordinates leave out a row that lacks a value of a declared hyper-parameter
MISSING_TEXT = "n/a"


def run_settings(spec: SweepSpec, point: Point, run_dir: Path) -> dict[str, Any]:
    """Every declared hyper-parameter of a run: its point's values; for a swept axis its point
    lacks (a block without it), the value its ``config.yaml`` records; the optimizer and mode
    from there too; :data:`MISSING_TEXT` for a text one it has no value of (AdamW's mode, a
    run that is no ``muoneq train`` run). A numeric axis a run has no value of (AdamW's
    momentum) stays missing: that run is in the table, not in the parallel coordinates."""
    from muoneq.suite.runtime import record

    saved = record.read_record(run_dir)
    flat = record.flatten(saved) if saved is not None else {}
    flat["optimizer"] = flat.get("optimizer.name")
    point_values, values = point.as_dict(), axis_values(spec)
    out = dict(point_values)
    for name in declared_hparams(spec):
        value = point_values.get(name, flat.get(name))
        if value is None and _type(values.get(name, ())) == api_pb2.DATA_TYPE_STRING:
            value = MISSING_TEXT
        if value is not None:
            out[name] = value
    return out


def write_session(spec: SweepSpec, point: Point, run_dir: Path, metrics: Mapping[str, Any],
                  diverged: bool = False) -> None:
    """One finished run's session (module docstring), beside its curves in
    ``<run dir>/tensorboard/``."""
    hparams = {**run_settings(spec, point, run_dir), STUDY_HPARAM: spec.study}
    start = plugin_data_pb2.SessionStartInfo(group_name=group_name(spec, point),
                                             start_time_secs=time.time())
    values = axis_values(spec)
    for name, value in hparams.items():
        start.hparams[name].CopyFrom(_value(value, _type(values.get(name, [value]))))
    status = api_pb2.STATUS_FAILURE if diverged else api_pb2.STATUS_SUCCESS
    end = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
    scalars = [summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=m, simple_value=float(metrics[m]))]) for m in declared_metrics(spec)
        if isinstance(metrics.get(m), int | float) and math.isfinite(metrics[m])]
    step = metrics.get("global_step")
    _write(Path(run_dir) / TENSORBOARD_DIR, [
        _summary(metadata.SESSION_START_INFO_TAG,
                 plugin_data_pb2.HParamsPluginData(session_start_info=start)),
        *scalars,
        _summary(metadata.SESSION_END_INFO_TAG,
                 plugin_data_pb2.HParamsPluginData(session_end_info=end))],
        step=step if isinstance(step, int) else 0, suffix=SESSION_SUFFIX)
