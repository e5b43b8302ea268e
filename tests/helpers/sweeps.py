"""Sweep files over the objective program, driver options, and a study's TensorBoard HParams
sessions read back with TensorBoard's own readers."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from tensorboard.plugins.hparams import metadata

from muoneq.suite.sweeps import DriverOptions
from muoneq.suite.sweeps.storage import open_storage

#: the driver's bookkeeping is tested on trials whose objective is a known function (they start
#: in a blink): this program, run by path
OBJECTIVE = Path(__file__).with_name("sweep_objective_program.py")
REPO = Path(__file__).resolve().parents[2]
COMMAND = f"{{python}} {OBJECTIVE} {{overrides}} seed={{seed}} run.dir={{run_dir}}"
#: the same program as a module, which a warm server forks (run from the checkout's root)
WARM_LAUNCH = {"command": "{python} -m tests.helpers.sweep_objective_program {overrides} "
                          "seed={seed} run.dir={run_dir}", "warm": True}


def write_sweep(path: Path, **fields) -> Path:
    spec = {
        "study": "tiny",
        "experiment": "teacher",
        "overrides": ["steps=20"],
        "seeds": [0, 1],
        "grid": [{"optimizer": ["muon_nes", "muoneq_nes"], "optimizer.lr": [0.02]}],
        "objective": {"metric": "val_loss", "direction": "minimize"},
        "launch": {"command": COMMAND},
        "retry": {"max_retries": 1, "heartbeat_s": 0.5, "stale_after_s": 5.0},
    }
    spec.update(fields)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def options(tmp_path: Path, **kw) -> DriverOptions:
    return DriverOptions(runs_dir=tmp_path / "runs", poll_s=0.2, tick_s=0.1, **kw)


def load(tmp_path: Path, study: str = "tiny", storage: str | None = None) -> optuna.Study:
    return optuna.load_study(study_name=study,
                             storage=open_storage(storage, tmp_path / "runs" / study))


def read(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's (step, value) pairs of a run, sorted: a run folder may hold several
    event files (a resumed run, the final validation), which TensorBoard reads in the order of
    their names (time, host, process id), not of the run."""
    events = read(run_dir / "tensorboard")
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag))
            for tag in events.Tags()["scalars"]}


def session(run_dir: Path) -> tuple[str, dict, dict[str, float]]:
    """A run's session: its group name, hparams and the last value of each scalar (read from
    its TensorBoard folder, where its curves also are)."""
    acc = read(run_dir / "tensorboard")
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(
        content[metadata.SESSION_START_INFO_TAG])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    scalars = {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}
    return start.group_name, hparams, scalars


def tensorboard_view(logdir: Path) -> tuple[list[str], dict[str, dict[str, float]]]:
    """What TensorBoard itself makes of ``tensorboard --logdir logdir``: its runs, by name (its
    Python loader, the plugin ``EventMultiplexer``), and its HParams plugin's sessions, by name,
    with their metrics (the plugin's own handler of the session table)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    tb_context = base_plugin.TBContext(data_provider=provider, logdir=str(logdir),
                                       multiplexer=multiplexer)
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=1000,
        allowed_statuses=[api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE])
    groups = list_session_groups.Handler(context.RequestContext(),
                                         backend_context.Context(tb_context), "", request).run()
    sessions = {s.name: {m.name.tag: m.value for m in s.metric_values}
                for g in groups.session_groups for s in g.sessions}
    return sorted(multiplexer.Runs()), sessions


def view_targets(study_dir: Path) -> dict[str, Path]:
    """The study's TensorBoard view: each run's short name → the run folder its link leads to
    (relative to the study folder)."""
    view = study_dir / "tensorboard"
    return {str(link.relative_to(view)): link.resolve().parent.relative_to(study_dir.resolve())
            for link in view.glob("*/seed*")}
