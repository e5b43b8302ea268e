"""One training run: run folder, seeding, resume, fit, test and ``metrics.json``.

A run folder (``run.dir``, default ``runs/<run.name>``) holds::

    config.yaml       the fully resolved config and its provenance (see
                      :mod:`muoneq.suite.runtime.record`): what ran, its fingerprint, who ran it
    routing.txt       every tensor's path (matrix/AdamW), the matrices the optimizer sees and
                      the rule that decided it (:func:`muoneq.describe_routing`)
    tensorboard/      TensorBoard scalars (by global step) and hparams (with declared metrics)
    checkpoints/      last-step<N>.ckpt (resume point) and best.ckpt (best monitored metric),
                      each with its SHA-256 (:mod:`muoneq.suite.runtime.checkpoints`)
    metrics.json      final figures; written last, only by a run that finished or diverged
                      (its "status")
    .run.lock         held by the run's one writer while it runs
                      (:mod:`muoneq.suite.runtime.run_folder`)
    .written          what the run wrote in checkpoints/ and tensorboard/, the only files it
                      ever removes there (:mod:`muoneq.suite.runtime.written`)

A sweep driver may treat the presence of ``metrics.json`` as the end of the run, and its
``status`` as how it ended.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import time
from pathlib import Path
from typing import NamedTuple, NoReturn

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

import muoneq
from muoneq.newton_schulz import dtype_name, resolve_dtype
from muoneq.suite import code_version
from muoneq.suite.errors import Diverged, Interrupted
from muoneq.suite.files import (
    atomic_write,
    full_disk_in_threads_said_once,
    reporting_full_disk,
    temporary_path,
)
from muoneq.suite.runtime import checkpoints, record, run_folder
from muoneq.suite.runtime.callbacks import Interruption, LastValidation, StepStats, Stop, StopNow
from muoneq.suite.runtime.checkpoints import (
    BEST_NAME,
    CHECKPOINT_DIR,
    FULL_DISK_THEN,
    BestCheckpoint,
)
from muoneq.suite.runtime.config import Resume
from muoneq.suite.runtime.metrics import HPARAMS_ENV, METRICS_FILE, TENSORBOARD_DIR
from muoneq.suite.runtime.module import ROUTING_FILE, compiles
from muoneq.suite.runtime.optim import build_optimizer_from_config
from muoneq.suite.runtime.record import CONFIG_FILE, RunFolderError
from muoneq.suite.runtime.tasks import get_task
from muoneq.suite.runtime.trainer import build_trainer, check_accelerator, lightning_config_error
from muoneq.suite.runtime.written import Written

__all__ = ["CONFIG_FILE", "METRICS_FILE", "RunFolderError", "find_resume_checkpoint", "train"]


def run_dir_of(cfg: DictConfig) -> Path:
    """``run.dir``, or ``<run.root>/<run.name>`` (a name is one folder name: checked when the
    config is composed, and here again, so that no name leads out of ``run.root``)."""
    if cfg.run.dir:
        return Path(cfg.run.dir)
    root = Path(cfg.run.root)
    run_dir = root / cfg.run.name
    if Path(os.path.normpath(run_dir)).parent != Path(os.path.normpath(root)):
        raise RunFolderError(f"run.name={cfg.run.name!r} leads out of run.root={root}; pass "
                             "another run.name")
    return run_dir


def find_resume_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact ``last-step<N>.ckpt`` of a run folder, or ``None``."""
    return checkpoints.resume_point(run_dir)[0]


def _declare_hparams(trainer: L.Trainer, cfg: DictConfig, metrics: list[str]) -> None:
    """The run's hyper-parameters in TensorBoard's HParams view, with ``metrics`` declared as
    its columns (it shows only declared ones). Lightning's ``log_hyperparams(metrics=...)``
    would also log each declared metric as a scalar at step 0; those NaN points are not data."""
    from torch.utils.tensorboard.summary import hparams

    params = {k: v if isinstance(v, bool | int | float | str) else str(v)
              for k, v in record.flatten(record.resolved(cfg)).items()}
    writer = trainer.logger.experiment._get_file_writer()
    for summary in hparams(params, dict.fromkeys(metrics, 0.0)):
        writer.add_summary(summary)


def _auto_values(cfg: DictConfig, trainer: L.Trainer) -> dict:
    """What the config's ``auto`` values are on this machine: the dtype Newton–Schulz runs in
    (``optimizer.ns_dtype=auto``: bfloat16 on accelerators and on CPUs with native bf16
    products, float32 on other CPUs) and whether the network is compiled
    (``trainer.compile=auto``: on CUDA)."""
    device = trainer.strategy.root_device
    auto = {}
    if "ns_dtype" in cfg.optimizer:
        auto["ns_dtype"] = dtype_name(resolve_dtype(cfg.optimizer.ns_dtype, device))
    if cfg.trainer.compile == "auto":
        auto["compile"] = compiles("auto", device)
    return auto


def _read_finished(metrics_path: Path) -> dict:
    """The figures of a finished run (one line naming the file when it is not readable)."""
    try:
        metrics = json.loads(metrics_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunFolderError(
            f"{metrics_path} is damaged ({type(err).__name__}: {err}), so the finished run's "
            "results cannot be read; restore it from a backup, or delete it and run again with "
            "resume=auto (the run restarts from its last checkpoint)") from None
    if not isinstance(metrics, dict):
        raise RunFolderError(f"{metrics_path} is not a JSON object; restore it from a backup, "
                             "or delete it and run again with resume=auto")
    return metrics


def continue_command(argv: list[str] | None) -> str:
    """The command that continues this run: the same one with ``resume=auto``."""
    if argv is None:  # called from Python: the caller's own call, with resume=auto
        return "the same call with resume=auto"
    words = [a for a in argv if not a.startswith("resume=")]
    return shlex.join(["muoneq", "train", *words, "resume=auto"])


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def _callback(trainer: L.Trainer, kind: type, **attrs):
    for cb in trainer.callbacks:
        if isinstance(cb, kind) and all(getattr(cb, k) == v for k, v in attrs.items()):
            return cb
    raise LookupError(kind)


def _keep_best(trainer: L.Trainer, best_cb: BestCheckpoint, score: float | None,
               mode: str) -> None:
    """Save ``best.ckpt`` from the final weights when their extra validation beats every
    validation of the fit (ModelCheckpoint only sees validations inside ``fit``; with
    ``trainer.save_best=false`` only the score is kept)."""
    previous = best_cb.best_model_score
    improves = score is not None and (previous is None or (
        score > float(previous) if mode == "max" else score < float(previous)))
    # rank 0 decides for all: saving is a collective under DDP/FSDP
    if trainer.strategy.broadcast(improves):
        path = str(Path(best_cb.dirpath) / f"{BEST_NAME}{best_cb.FILE_EXTENSION}")
        best_cb.best_model_score, best_cb.best_model_path = torch.tensor(score), path
        best_cb.save_best(trainer, path)


def train(cfg: DictConfig, *, callbacks=(), argv: list[str] | None = None) -> dict:
    """Run ``cfg`` to the end and return the figures written to ``metrics.json``.

    ``resume=never`` refuses a run folder that holds checkpoints or metrics. ``resume=auto``
    continues from its newest complete ``last`` checkpoint, or returns the saved figures of a
    run that already finished, but only when that run computed what ``cfg`` computes (equal
    fingerprints: every key that can change the result, and the number of processes); otherwise
    it raises :class:`RunFolderError` with one line per differing key and leaves the folder as
    it was. A finished run is never extended (see
    :func:`muoneq.suite.runtime.record.check_same_run`).
    Extra Lightning ``callbacks`` (e.g. a pruning callback) are added to the trainer's.

    The run folder has one writer: a second run there is refused naming the first, and links
    and cleaning follow :mod:`muoneq.suite.runtime.run_folder`. Checkpoints are verified before a
    resume: a damaged one is named, kept as ``*.damaged`` and the previous intact one is used; one
    of another run or step, or data changed since it was saved (unless
    ``run.accept_changed_data``), is refused (:mod:`muoneq.suite.runtime.checkpoints`). A NaN/inf
    loss or validation metric writes ``metrics.json`` with ``"status": "diverged"`` and raises
    :class:`~muoneq.suite.errors.Diverged`; SIGINT/SIGTERM, while training or during the final
    validation and test, saves the current step and raises
    :class:`~muoneq.suite.errors.Interrupted` with the command that continues the run; a full disk
    raises :class:`~muoneq.suite.errors.DiskFull` naming the folder.
    """
    started = time.perf_counter()
    check_accelerator(cfg.trainer)  # first: nothing else matters on the wrong machine
    run_dir = run_dir_of(cfg)
    notes = run_folder.check_paths(cfg, run_dir)
    _check_ours(run_dir)  # before the lock is made there: a folder not ours is left untouched
    # one writer per run folder: rank 0 holds it for every process of its run
    writer = run_folder.hold(run_dir, argv) if rank_zero_only.rank == 0 else (
        contextlib.nullcontext())
    # a full disk anywhere in the run is one line (the writes that know their file name it)
    with reporting_full_disk(run_dir, FULL_DISK_THEN), full_disk_in_threads_said_once(), writer:
        for note in notes if rank_zero_only.rank == 0 else ():
            print(note)
        return _train(cfg, run_dir, callbacks, argv, started)


def _train(cfg: DictConfig, run_dir: Path, callbacks, argv: list[str] | None,
           started: float) -> dict:
    """:func:`train` once the run folder is this run's alone."""
    start = _resume_or_refuse(cfg, run_dir)
    if start.finished is not None:
        return start.finished

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, datamodule = get_task(cfg.task.name).build(cfg)
    data = getattr(datamodule, "data_identity", lambda: None)()
    if start.checkpoint is not None:
        _check_stamp(cfg, run_dir, start, data, module)
    fingerprint = (start.previous["provenance"]["fingerprint"] if start.checkpoint is not None
                   else record.config_fingerprint(record.resolved(cfg)))
    monitor = OmegaConf.to_object(cfg.spectra).monitor() if cfg.spectra.enabled else None
    callbacks = [*callbacks, checkpoints.RunStamp(fingerprint, data),
                 *([monitor] if monitor is not None else [])]
    trainer = build_trainer(
        cfg, run_dir, monitor=module.monitor, monitor_mode=module.monitor_mode,
        callbacks=callbacks,
    )
    if start.checkpoint is not None:
        record.check_same_run(run_dir, start.previous, cfg, finished=False,
                              world_size=trainer.world_size)
    if trainer.is_global_zero:
        _open_session(trainer, cfg, module, run_dir, start, argv, monitor)

    interruption = _callback(trainer, Interruption)
    try:
        with interruption.installed():  # until metrics.json is written: a signal is never lost
            figures = _session(trainer, cfg, module, datamodule, run_dir, start.checkpoint, argv,
                               started)
            return _write_metrics(trainer, cfg, module, run_dir, started, figures)
    except StopNow:
        raise Interrupted(
            f"training of {run_dir} stopped at once by a second SIGINT (Ctrl-C) at step "
            f"{trainer.global_step}, {_UNSAVED}: {continue_command(argv)}",
            exit_code=128 + signal.SIGINT) from None


class _Start(NamedTuple):
    """Where :func:`train` starts: the folder's ``config.yaml`` record (``None``: a new run),
    the checkpoint to resume from and the damaged ones set aside, or the figures of a run that
    already finished (nothing to train)."""

    previous: dict | None
    checkpoint: Path | None = None
    damaged: list[tuple[Path, str]] | tuple = ()
    finished: dict | None = None


def _check_ours(run_dir: Path) -> dict | None:
    """The run folder's ``config.yaml`` record (None: a new run); :class:`RunFolderError` for a
    folder that holds what ``muoneq train`` writes but is not a run folder of it. Reads only."""
    previous = record.read_record(run_dir)
    if previous is None and not (run_dir / METRICS_FILE).is_file():
        made = [what for what, there in (
            (f"{CHECKPOINT_DIR}/", bool(checkpoints.last_checkpoints(run_dir))),
            (f"{TENSORBOARD_DIR}/", run_folder.holds_tensorboard_files(run_dir)),
            (ROUTING_FILE, (run_dir / ROUTING_FILE).exists())) if there]
        if made:  # a run would write over them
            raise RunFolderError(
                f"{run_dir} holds {' and '.join(made)} but no {CONFIG_FILE}, so it is not a run "
                "folder of muoneq train and is left alone; choose another run.dir or run.name")
    return previous


def _resume_or_refuse(cfg: DictConfig, run_dir: Path) -> _Start:
    """Read ``run_dir`` under ``cfg.resume``: refuse a folder that is not a run folder, or that
    holds another run or a finished one without ``resume=auto``; else say where to start."""
    metrics_path = run_dir / METRICS_FILE
    finished = metrics_path.is_file()
    stored = [] if finished else checkpoints.last_checkpoints(run_dir)
    previous = _check_ours(run_dir)
    if not (finished or stored):
        return _Start(previous)
    what = f"a finished run ({METRICS_FILE})" if finished else "an unfinished run's checkpoints"
    if cfg.resume is not Resume.auto:
        raise RunFolderError(
            f"{run_dir} holds {what}; pass resume=auto to "
            f"{'read its results' if finished else 'continue it'}, or start a new run in "
            "another folder (another run.dir or run.name)")
    if previous is None:
        raise RunFolderError(
            f"{run_dir} holds {what} but no {CONFIG_FILE}, so what it ran cannot be "
            "checked; start the run in another folder (another run.dir or run.name)")
    record.check_same_run(run_dir, previous, cfg, finished=finished)
    if finished:
        metrics = _read_finished(metrics_path)
        if metrics.get("status") == "diverged":
            raise diverged_error(run_dir, metrics.get("diverged_at_step"),
                                 metrics.get("diverged"))
        print(f"muoneq: {run_dir} already finished with these settings; its {METRICS_FILE} "
              "is the result (nothing to do)")
        return _Start(previous, finished=metrics)
    checkpoint, damaged = checkpoints.resume_point(run_dir)
    return _Start(previous, checkpoint, damaged)


def _check_stamp(cfg: DictConfig, run_dir: Path, start: _Start, data: dict | None,
                 module) -> None:
    """Refuse to resume from a checkpoint that another run saved, that holds another step than
    its name says, or whose data changed since (unless ``run.accept_changed_data``): what its
    :class:`~muoneq.suite.runtime.checkpoints.RunStamp` says against this run; a checkpoint
    without one, of a run started before checkpoints were stamped, by what it holds against
    ``module`` (built from the config) and the config
    (:func:`~muoneq.suite.runtime.checkpoints.unstamped_mismatch`)."""
    path = start.checkpoint
    saved = checkpoints.read_checkpoint(path)
    step, stamp = checkpoints.read_stamp(saved)
    how = (f"move it out of {CHECKPOINT_DIR}/ to resume from the previous checkpoint, or start "
           "the run again in another folder (another run.dir or run.name)")
    named = checkpoints.step_of(path)
    if step is not None and step != named:
        raise checkpoints.CheckpointError(
            f"{path} holds step {step}, not the step {named} its name says (a checkpoint "
            f"renamed or copied in); {how}")
    if stamp is None:
        if start.previous["provenance"].get(record.STAMPED):
            raise checkpoints.CheckpointError(
                f"{path} carries no stamp of its run, and every checkpoint this run saves has "
                f"one ({CONFIG_FILE} says {record.STAMPED}: true): another run saved it, or a "
                f"version of muoneq that stamped none, and it was copied in; {how}")
        # a run started before checkpoints were stamped: what can be checked without one
        groups = build_optimizer_from_config(module.model, module.optimizer_config).param_groups
        resumed = [entry.get("from_checkpoint") or "" for entry in
                   start.previous["provenance"].get("resumed") or []]
        mismatch = checkpoints.unstamped_mismatch(
            saved, module, groups, max_steps=cfg.trainer.max_steps,
            max_epochs=cfg.trainer.max_epochs or -1, resumed=resumed)
        if mismatch is not None:
            raise checkpoints.CheckpointError(
                f"{path} carries no stamp of its run (the run was started by a version of muoneq "
                f"that stamped none), and {mismatch}: another run saved it; {how}")
        return
    fingerprint = start.previous["provenance"]["fingerprint"]
    if stamp.get("fingerprint") != fingerprint:
        raise checkpoints.CheckpointError(
            f"{path} is a checkpoint of another run (fingerprint {stamp.get('fingerprint')}; "
            f"this run's {CONFIG_FILE} says {fingerprint}); {how}")
    changed = checkpoints.data_changes(stamp.get("data"), data)
    if changed and not cfg.run.accept_changed_data:
        raise RunFolderError(
            f"{run_dir}: the data changed since {path.name} was saved (below), so resuming "
            "would train the rest of the run on other data than its start; restore the data, "
            "or continue on the new data knowingly with run.accept_changed_data=true (its "
            f"{CONFIG_FILE} records the session), or start the run again in another folder",
            details=changed)
    if changed and rank_zero_only.rank == 0:
        print(f"muoneq: note: {run_dir} continues on changed data "
              f"(run.accept_changed_data=true): {'; '.join(changed)}")


def _open_session(trainer: L.Trainer, cfg: DictConfig, module, run_dir: Path, start: _Start,
                  argv: list[str] | None, monitor=None) -> None:
    """On rank 0: set the damaged checkpoints aside, list what the session writes in
    ``tensorboard/`` (``monitor``: the spectral monitor, if any), record the session (a new
    run's ``config.yaml``, or one more session of a resumed one) and declare the HParams
    view."""
    auto = _auto_values(cfg, trainer)
    then = (f"the run resumes from {start.checkpoint.name}" if start.checkpoint is not None
            else "no intact checkpoint is left: the run starts over")
    for path, reason in start.damaged:
        kept = checkpoints.set_aside(path)
        print(f"muoneq: note: {path} is damaged ({reason}); it is kept as {kept.name} and "
              f"{then}")
    run_folder.remove_partial_writes(run_dir)  # of a killed session's last writes
    if start.checkpoint is None and start.previous is not None:
        run_folder.clear_attempt(run_dir)
    # before any is written: this session's event files, Lightning's hparams.yaml, the spectra
    tensorboard = [trainer.logger.events, trainer.logger.NAME_HPARAMS_FILE]
    if monitor is not None:
        tensorboard += [monitor.csv_name, temporary_path(monitor.csv_name).name]
    Written(run_dir).record(TENSORBOARD_DIR, *tensorboard)
    if start.checkpoint is None:
        record.write_new(run_dir, cfg, argv, trainer.world_size, auto)
    else:
        record.add_session(run_dir, start.previous, cfg, argv, start.checkpoint, auto)
        print(f"muoneq: resuming {run_dir} from {start.checkpoint.name}")
    summary = ["metrics/best", "metrics/final"] if module.monitor else []
    if os.environ.get(HPARAMS_ENV) != "0":  # else a sweep writes the HParams view
        _declare_hparams(trainer, cfg, [*summary, *module.hparam_metrics])


def _session(trainer: L.Trainer, cfg: DictConfig, module, datamodule, run_dir: Path,
             checkpoint: Path | None, argv: list[str] | None, started: float) -> dict:
    """``trainer.fit`` from ``checkpoint``, then the final validation and test: the figures of a
    finished run. A divergence is recorded and raised as
    :class:`~muoneq.suite.errors.Diverged`, a signal (during training or after it) as
    :class:`~muoneq.suite.errors.Interrupted`."""
    try:
        with reporting_full_disk(run_dir, then="re-run the same command with resume=auto"):
            trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
            fit_metrics, best, final = _scores(trainer, module, datamodule)
            tests = _test_metrics(trainer, module, datamodule)
            _callback(trainer, Interruption).after_training(trainer)
    except Stop as stop:
        if stop.checkpoint is None:
            _diverged(trainer, cfg, module, run_dir, stop, started)
        raise Interrupted(
            f"training of {run_dir} {stop.what} after step {stop.step}, saved as "
            f"{CHECKPOINT_DIR}/{stop.checkpoint.name}; continue it with: "
            f"{continue_command(argv)}", exit_code=128 + stop.signum) from None
    except MisconfigurationException as err:  # what Lightning checks once it has the data
        raise lightning_config_error(err, "fix that trainer setting") from None
    except SIGTERMException:  # Lightning's handler saw it first (before training began)
        raise Interrupted(
            f"training of {run_dir} stopped by SIGTERM at step {trainer.global_step}, "
            f"{_UNSAVED}: {continue_command(argv)}", exit_code=128 + signal.SIGTERM) from None
    return {"status": "finished", "best": best, "final": final,
            **{k: v for k, v in fit_metrics.items() if not k.startswith("test/")}, **tests}


#: What an interruption that could not save its step says.
_UNSAVED = "before the step could be saved; continue it from its last checkpoint with"


def _scores(trainer: L.Trainer, module, datamodule) -> tuple[dict, float | None, float | None]:
    """The fit's last logged metrics and the best and final monitored values; the final weights
    are validated once more when the budget ended between validations."""
    fit_metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
    if module.monitor is None:
        return fit_metrics, None, None
    best_cb = _callback(trainer, BestCheckpoint, monitor=module.monitor)
    if (_callback(trainer, LastValidation).step != trainer.global_step
            or module.monitor not in trainer.callback_metrics):
        # the budget ended between validations, or a session that trained nothing continues a
        # run stopped after its last step: validate the final weights (once more)
        fit_metrics |= {k: _number(v) for k, v in trainer.validate(
            module, datamodule=datamodule, verbose=False)[0].items()}
        _keep_best(trainer, best_cb, fit_metrics.get(module.monitor), module.monitor_mode)
    final = fit_metrics.get(module.monitor)
    scores = [_number(best_cb.best_model_score)] if best_cb.best_model_score is not None else []
    scores = [s for s in (*scores, final) if s is not None]
    best = (max if module.monitor_mode == "max" else min)(scores) if scores else None
    if trainer.is_global_zero:
        trainer.logger.log_metrics(
            {k: v for k, v in (("metrics/best", best), ("metrics/final", final))
             if v is not None}, step=trainer.global_step)
    return fit_metrics, best, final


def _test_metrics(trainer: L.Trainer, module, datamodule) -> dict:
    """The test set's metrics, when the task defines a test step and data."""
    if not (is_overridden("test_step", module) and is_overridden("test_dataloader", datamodule)):
        return {}
    results = trainer.test(module, datamodule=datamodule, verbose=False)
    return {k: _number(v) for k, v in (results[0] if results else {}).items()}


def _write_metrics(trainer: L.Trainer, cfg: DictConfig, module, run_dir: Path, started: float,
                   figures: dict) -> dict:
    """Write ``metrics.json`` (rank 0) from the run's ``figures`` and what every run records;
    return it."""
    metrics = {
        "status": figures.pop("status"),
        "task": cfg.task.name,
        "optimizer": cfg.optimizer.name,
        "seed": cfg.seed,
        "paper_metric": module.paper_metric,
        "monitor": module.monitor,
        "monitor_mode": module.monitor_mode if module.monitor else None,
        **figures,
        **_callback(trainer, StepStats).summary(),
        "wall_clock_s": time.perf_counter() - started,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "world_size": trainer.world_size,
        **module.final_metrics(),
        "run_dir": str(run_dir),
        "muoneq_version": muoneq.__version__,
        "git_commit": code_version.taken().commit,
    }
    metrics = {k: _number(v) if isinstance(v, float) else v for k, v in metrics.items()}
    if trainer.is_global_zero:
        atomic_write(run_dir / METRICS_FILE, json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics


def _diverged(trainer: L.Trainer, cfg: DictConfig, module, run_dir: Path, stop: Stop,
              started: float) -> NoReturn:
    """Record a run that :class:`~muoneq.suite.runtime.callbacks.Divergence` stopped:
    ``metrics.json``
    with ``"status": "diverged"``, the step and what was not finite, the best validation value
    before it; then raise :class:`~muoneq.suite.errors.Diverged`."""
    best = None
    if module.monitor is not None:
        score = _callback(trainer, BestCheckpoint, monitor=module.monitor).best_model_score
        best = None if score is None else _number(score)
    _write_metrics(trainer, cfg, module, run_dir, started, {
        "status": "diverged", "diverged_at_step": stop.step, "diverged": stop.what,
        "best": best, "final": None})
    raise diverged_error(run_dir, stop.step, stop.what)


def diverged_error(run_dir: Path, step: int, what: str) -> Diverged:
    return Diverged(
        f"{run_dir} diverged at step {step}: {what}; its {METRICS_FILE} says \"status\": "
        "\"diverged\" (lower optimizer.lr, or raise trainer.divergence_patience to tolerate "
        "isolated non-finite values)")
