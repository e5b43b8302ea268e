"""What makes a run what it is: the config keys that can change its result (the rest are left
out of its fingerprint, :mod:`muoneq.suite.runtime.record`) and the default run name built from
the command-line settings among them."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from muoneq.suite.runtime.config.sources import GROUPS

#: Keys (or sections, ending in ".") of a run config that cannot change what a run computes:
#: where it is written, how progress is shown, how often it logs and checkpoints (resume is
#: exact from any checkpoint) and whether it keeps ``best.ckpt``, the loader's worker
#: processes (every task's data order and augmentation are functions of the seed, epoch and
#: sample only) and whether data may be downloaded. They are left out of a run's fingerprint
#: (:mod:`muoneq.suite.runtime.record`) and of its default folder name; every other key, the
#: device layout included (``trainer.devices``, ``trainer.num_nodes``, ``trainer.strategy``:
#: they change the per-device batch, hence BatchNorm statistics and the order of reductions),
#: is part of what a run is.
NON_RESULT_KEYS = (
    "run.", "resume", "trainer.progress", "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps", "trainer.save_best", "task.data.num_workers",
    "task.data.download",
)


def is_result_key(key: str) -> bool:
    """Whether the dotted config ``key`` can change what a run computes (see NON_RESULT_KEYS)."""
    return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NON_RESULT_KEYS)


def resolved_value(cfg: DictConfig, key: str):
    """The plain, resolved value of a dotted key (enums as their names, containers as lists
    and dicts)."""
    wrapped = OmegaConf.create({"value": OmegaConf.select(cfg, key)})
    return OmegaConf.to_container(wrapped, resolve=True, enum_to_str=True)["value"]


def default_run_name(choices: dict, cfg: DictConfig, args: Sequence[str]) -> str:
    """``<experiment or task>-<optimizer>-seed<seed>``, then, for command-line settings that can
    change the result (group choices such as ``trainer=gpu`` and overrides, see
    :data:`NON_RESULT_KEYS`), a readable summary cut at 60 characters and an 8-digit hash of
    their resolved values (``optimizer.lr=5e-2`` and ``optimizer.lr=0.05`` are the same run).
    Only letters, digits and ``-_.=`` are used, so the name is safe in any shell and path."""
    base = Path(choices["experiment"] or choices["task"]).stem
    name = f"{base}-{Path(choices['optimizer']).stem}-seed{cfg.seed}"
    settings: dict[str, object] = {}
    for arg in args:
        key, value = arg.split("=", 1)
        if key in GROUPS:
            if key not in ("experiment", "optimizer"):
                settings[key] = Path(value).stem
        elif key != "seed" and is_result_key(key):
            settings[key] = resolved_value(cfg, key)
    if not settings:
        return name
    items = sorted(settings.items())
    digest = hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(
        f"{k}={json.dumps(v) if isinstance(v, list | dict) else v}" for k, v in items))
    readable = re.sub(r"_+", "_", readable)[:60].strip("_-")
    return f"{name}-{readable}-{digest}"
