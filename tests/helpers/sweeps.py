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
