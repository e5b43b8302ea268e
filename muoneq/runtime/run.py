"""One training run: run folder, seeding, resume, fit, test and ``metrics.json``.

A run folder (``run.dir``, default ``runs/<run.name>``) holds::

    config.yaml       the fully resolved config and its provenance (see
                      :mod:`muoneq.runtime.record`): what ran, its fingerprint, who ran it
    routing.txt       every tensor's path (matrix/AdamW), the matrices the optimizer sees and
                      the rule that decided it (:func:`muoneq.describe`)
    tensorboard/      TensorBoard scalars (by global step) and hparams (with declared metrics)
    checkpoints/      last-step<N>.ckpt (resume point) and best.ckpt (best monitored metric)
    metrics.json      final figures; written last, only by a run that finished

A sweep driver may treat the presence of ``metrics.json`` as success.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

import muoneq
from muoneq.errors import Interrupted
from muoneq.newton_schulz import dtype_name, resolve_dtype
from muoneq.runtime import record
from muoneq.runtime.callbacks import LastValidation, StepStats
from muoneq.runtime.config import Resume
from muoneq.runtime.metrics import HPARAMS_ENV, METRICS_FILE
from muoneq.runtime.record import CONFIG_FILE, RunFolderError, atomic_write
from muoneq.runtime.tasks import get_task
from muoneq.runtime.trainer import (
    BEST_NAME,
    CHECKPOINT_DIR,
    LAST_PREFIX,
    TENSORBOARD_DIR,
    build_trainer,
    check_accelerator,
)

__all__ = ["CONFIG_FILE", "METRICS_FILE", "RunFolderError", "find_resume_checkpoint", "train"]


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path(cfg.run.root) / cfg.run.name


def _checkpoint_complete(path: Path) -> bool:
    """Whether a checkpoint was written to the end: ``torch.save`` writes a zip archive whose
    central directory comes last, so a file cut short by a kill is not a zip file; a
    distributed (FSDP2) checkpoint is a folder whose ``.metadata`` is written last."""
    if path.is_dir():
        return (path / ".metadata").is_file()
    return zipfile.is_zipfile(path)


def find_resume_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``last-step<N>.ckpt`` of a run folder, or ``None``."""
    pattern = re.compile(re.escape(LAST_PREFIX) + r"(\d+)\.ckpt$")
    found = []
    for path in (Path(run_dir) / CHECKPOINT_DIR).glob(f"{LAST_PREFIX}*.ckpt"):
        if match := pattern.match(path.name):
            found.append((int(match.group(1)), path))
    for _, path in sorted(found, reverse=True):
        if _checkpoint_complete(path):
            return path
    return None


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
    (``optimizer.ns_dtype=auto``: float32 on CPU, bfloat16 on accelerators)."""
    if "ns_dtype" not in cfg.optimizer:
        return {}
    dtype = resolve_dtype(cfg.optimizer.ns_dtype, trainer.strategy.root_device)
    return {"ns_dtype": dtype_name(dtype)}


def _clear_attempt(run_dir: Path) -> None:
    """Remove the TensorBoard events and partial checkpoints of an earlier attempt in this run
    folder that saved no checkpoint (its curves would mix with this run's). Only a folder with
    a ``config.yaml`` is a run folder; nothing else is ever deleted."""
    if not (run_dir / CONFIG_FILE).is_file():
        return
    leftovers = [run_dir / d for d in (TENSORBOARD_DIR, CHECKPOINT_DIR) if (run_dir / d).is_dir()]
    if leftovers:
        print(f"muoneq: note: {run_dir} holds an earlier attempt that saved no checkpoint; "
              "starting over (its tensorboard/ and checkpoints/ are removed)")
    for path in leftovers:
        shutil.rmtree(path)


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def _callback(trainer: L.Trainer, kind: type, **attrs):
    for cb in trainer.callbacks:
        if isinstance(cb, kind) and all(getattr(cb, k) == v for k, v in attrs.items()):
            return cb
    raise LookupError(kind)


def _keep_best(trainer: L.Trainer, best_cb: ModelCheckpoint, score: float | None,
               mode: str) -> None:
    """Save ``best.ckpt`` from the final weights when their extra validation beats every
    validation of the fit (ModelCheckpoint only sees validations inside ``fit``)."""
    previous = best_cb.best_model_score
    improves = score is not None and (previous is None or (
        score > float(previous) if mode == "max" else score < float(previous)))
    # rank 0 decides for all: saving is a collective under DDP/FSDP
    if trainer.strategy.broadcast(improves):
        path = str(Path(best_cb.dirpath) / f"{BEST_NAME}{best_cb.FILE_EXTENSION}")
        trainer.save_checkpoint(path)
        best_cb.best_model_score, best_cb.best_model_path = torch.tensor(score), path


def train(cfg: DictConfig, *, callbacks=(), argv: list[str] | None = None) -> dict:
    """Run ``cfg`` to the end and return the figures written to ``metrics.json``.

    ``resume=never`` refuses a run folder that holds checkpoints or metrics. ``resume=auto``
    continues from its newest complete ``last`` checkpoint, or returns the saved figures of a
    run that already finished, but only when that run computed what ``cfg`` computes (equal
    fingerprints: every key that can change the result, and the number of processes); otherwise
    it raises :class:`RunFolderError` with one line per differing key and leaves the folder as
    it was. A finished run is never extended (see :func:`muoneq.runtime.record.check_same_run`).
    Extra Lightning ``callbacks`` (e.g. a pruning callback) are added to the trainer's.
    """
    started = time.perf_counter()
    check_accelerator(cfg.trainer)  # first: nothing else matters on the wrong machine
    run_dir = run_dir_of(cfg)
    metrics_path = run_dir / METRICS_FILE
    finished = metrics_path.is_file()
    checkpoint = None if finished else find_resume_checkpoint(run_dir)
    previous = record.read_record(run_dir)
    if finished or checkpoint is not None:
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
            print(f"muoneq: {run_dir} already finished with these settings; its {METRICS_FILE} "
                  "is the result (nothing to do)")
            return json.loads(metrics_path.read_text())

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, datamodule = get_task(cfg.task.name).build(cfg)
    if cfg.spectra.enabled:
        callbacks = [*callbacks, OmegaConf.to_object(cfg.spectra).monitor()]
    trainer = build_trainer(
        cfg, run_dir, monitor=module.monitor, monitor_mode=module.monitor_mode,
        callbacks=callbacks,
    )
    if checkpoint is not None:
        record.check_same_run(run_dir, previous, cfg, finished=False,
                              world_size=trainer.world_size)
    if trainer.is_global_zero:
        auto = _auto_values(cfg, trainer)
        if checkpoint is None:
            _clear_attempt(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            record.write_new(run_dir, cfg, argv, trainer.world_size, auto)
        else:
            record.add_session(run_dir, previous, cfg, argv, checkpoint, auto)
            print(f"muoneq: resuming {run_dir} from {checkpoint.name}")
        summary = ["metrics/best", "metrics/final"] if module.monitor else []
        if os.environ.get(HPARAMS_ENV) != "0":  # else a sweep writes the HParams view
            _declare_hparams(trainer, cfg, [*summary, *module.hparam_metrics])

    trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    if trainer.interrupted:
        raise Interrupted(
            f"training of {run_dir} was interrupted, no {METRICS_FILE} written; re-run the same "
            "command with resume=auto to continue from its last checkpoint")
    fit_metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
    best = final = None
    if module.monitor is not None:
        best_cb = _callback(trainer, ModelCheckpoint, monitor=module.monitor)
        if _callback(trainer, LastValidation).step != trainer.global_step:
            # the budget ended between validations: validate the final weights once more
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

    test_metrics = {}
    if is_overridden("test_step", module) and is_overridden("test_dataloader", datamodule):
        results = trainer.test(module, datamodule=datamodule, verbose=False)
        test_metrics = {k: _number(v) for k, v in (results[0] if results else {}).items()}

    metrics = {
        "status": "finished",
        "task": cfg.task.name,
        "optimizer": cfg.optimizer.name,
        "seed": cfg.seed,
        "paper_metric": module.paper_metric,
        "monitor": module.monitor,
        "monitor_mode": module.monitor_mode if module.monitor else None,
        "best": best,
        "final": final,
        **{k: v for k, v in fit_metrics.items() if not k.startswith("test/")},
        **test_metrics,
        **_callback(trainer, StepStats).summary(module.device),
        "wall_clock_s": time.perf_counter() - started,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "world_size": trainer.world_size,
        **module.final_metrics(),
        "run_dir": str(run_dir),
        "muoneq_version": muoneq.__version__,
        "git_commit": record.git_commit(),
    }
    metrics = {k: _number(v) if isinstance(v, float) else v for k, v in metrics.items()}
    if trainer.is_global_zero:
        atomic_write(metrics_path, json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics
