"""One training run: run folder, seeding, resume, fit, test and ``metrics.json``.

A run folder (``run.dir``, default ``runs/<run.name>``) holds::

    config.yaml       the fully resolved config, plus a ``provenance`` section (package
                      version, git commit, command line, host, versions)
    tensorboard/      TensorBoard scalars and hparams (with declared metrics)
    checkpoints/      last-step<N>.ckpt (resume point) and best.ckpt (best monitored metric)
    metrics.json      final figures; written last, only by a run that finished

A sweep driver may treat the presence of ``metrics.json`` as success.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

import muoneq
from muoneq.runtime.callbacks import LastValidation, StepStats
from muoneq.runtime.config import Resume
from muoneq.runtime.tasks import get_task
from muoneq.runtime.trainer import BEST_NAME, CHECKPOINT_DIR, LAST_PREFIX, build_trainer

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.yaml"


class RunFolderError(RuntimeError):
    """The run folder holds another run's results and ``resume`` does not allow reusing it."""


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


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(muoneq.__file__).parent, capture_output=True, text=True,
            timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def provenance(argv: list[str] | None = None) -> dict:
    """What produced a run: package version, git commit, command line, host and versions."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "muoneq_version": muoneq.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "command": " ".join(["muoneq", "train", *argv]) if argv is not None else " ".join(sys.argv),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "lightning": L.__version__,
    }


def _resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _write_config(run_dir: Path, cfg: DictConfig, argv: list[str] | None, resumed_from) -> None:
    path = run_dir / CONFIG_FILE
    resolved = _resolved(cfg)
    if resumed_from is not None and path.is_file():
        before = _flatten({k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items()
                           if k != "provenance"})
        now = _flatten(resolved)
        changed = sorted(k for k in before.keys() | now.keys()
                         if k != "resume" and before.get(k) != now.get(k))
        if changed:
            print(f"muoneq: note: resuming with a config that differs at: {', '.join(changed)}")
    document = {**resolved, "provenance": {**provenance(argv), "resumed_from": (
        str(resumed_from) if resumed_from is not None else None)}}
    _atomic_write(path, OmegaConf.to_yaml(OmegaConf.create(document)))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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

    ``resume=never`` refuses a run folder that holds checkpoints or metrics; ``resume=auto``
    continues from its newest complete ``last`` checkpoint (or returns the saved figures of a
    run that already finished). Extra Lightning ``callbacks`` (e.g. a pruning callback) are added
    to the trainer's.
    """
    started = time.perf_counter()
    run_dir = run_dir_of(cfg)
    resume = cfg.resume is Resume.auto
    metrics_path = run_dir / METRICS_FILE
    if metrics_path.is_file():
        if resume:
            print(f"muoneq: {run_dir} already finished ({METRICS_FILE} present); nothing to do")
            return json.loads(metrics_path.read_text())
        raise RunFolderError(
            f"{run_dir} holds a finished run ({METRICS_FILE}); choose another run.name or "
            "run.dir, or delete the folder"
        )
    checkpoint = find_resume_checkpoint(run_dir)
    if checkpoint is not None and not resume:
        raise RunFolderError(
            f"{run_dir} holds checkpoints of an unfinished run: pass resume=auto to continue "
            "it, or choose another run.name / run.dir"
        )

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, datamodule = get_task(cfg.task.name).build(cfg)
    if cfg.spectra.enabled:
        callbacks = [*callbacks, OmegaConf.to_object(cfg.spectra).monitor()]
    trainer = build_trainer(
        cfg, run_dir, monitor=module.monitor, monitor_mode=module.monitor_mode,
        callbacks=callbacks,
    )
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, cfg, argv, checkpoint)
        declared = {"metrics/best": math.nan, "metrics/final": math.nan}
        declared |= {name: math.nan for name in module.hparam_metrics}
        trainer.logger.log_hyperparams(_resolved(cfg), metrics=declared)
        if checkpoint is not None:
            print(f"muoneq: resuming {run_dir} from {checkpoint.name}")

    trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    if trainer.interrupted:
        raise RuntimeError(
            f"training of {run_dir} was interrupted; no {METRICS_FILE} written "
            "(resume=auto continues from the last checkpoint)"
        )
    fit_metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
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
            {k: v for k, v in (("metrics/best", best), ("metrics/final", final)) if v is not None},
            step=trainer.global_step,
        )

    test_metrics = {}
    if is_overridden("test_step", module) and is_overridden("test_dataloader", datamodule):
        results = trainer.test(module, datamodule=datamodule, verbose=False)
        test_metrics = {k: _number(v) for k, v in (results[0] if results else {}).items()}

    metrics = {
        "status": "finished",
        "task": cfg.task.name,
        "optimizer": cfg.optimizer.name,
        "seed": cfg.seed,
        "monitor": module.monitor,
        "monitor_mode": module.monitor_mode,
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
        "git_commit": _git("rev-parse", "HEAD"),
    }
    metrics = {k: _number(v) if isinstance(v, float) else v for k, v in metrics.items()}
    if trainer.is_global_zero:
        _atomic_write(metrics_path, json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics
