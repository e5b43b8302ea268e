"""A run folder's record: ``config.yaml`` (what ran, and who ran it) and the checks that keep it
true when a run is continued.

``config.yaml`` holds the fully resolved config and a ``provenance`` section: the package
version, the git commit and dirty state of the code the process imported (with ``forked_from``,
the warm server it was forked from: :mod:`muoneq.suite.code_version`), command line, host and
library versions of the session that started the run, its ``fingerprint`` (a hash of every key
that can change the result, see :data:`muoneq.suite.runtime.config.NON_RESULT_KEYS`), the number
of processes (``world_size``), and one entry in ``resumed`` per later session (with any non-
result keys it changed). It is written when a run starts and is never rewritten with settings
the run did not use: a session whose config differs in a key that can change the result is
refused before it touches the folder (:func:`check_same_run`). A key the run's ``config.yaml``
lacks (the run is older than the key) counts as equal when it is at its schema default now: a
key is only ever added with a default that keeps the behaviour runs had before it existed.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import platform
import socket
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import muoneq
from muoneq.suite import code_version
from muoneq.suite.errors import UserError
from muoneq.suite.files import atomic_write
from muoneq.suite.runtime.config import is_result_key

CONFIG_FILE = "config.yaml"
#: Keys of config.yaml that are not part of the run config.
RECORD_KEYS = ("provenance",)
#: The keys that set a run's length: a finished run differing only in them would be an extension.
BUDGET_KEYS = ("trainer.max_steps", "trainer.max_epochs")
#: Differing keys listed in a refusal (the rest are counted).
MAX_SHOWN = 20
#: The ``provenance`` key of a run every checkpoint of which carries its stamp
#: (:class:`muoneq.suite.runtime.checkpoints.RunStamp`): a checkpoint without one is not its own.
STAMPED = "stamped_checkpoints"


class RunFolderError(UserError, RuntimeError):
    """The run folder holds another run's results and ``resume`` does not allow reusing it."""


def resolved(cfg: DictConfig) -> dict:
    """The config as plain data: interpolations resolved, enums as their names."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists stay values)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def result_settings(config: dict) -> dict:
    """The flattened keys of a resolved config that can change the result."""
    flat = flatten({k: v for k, v in config.items() if k not in RECORD_KEYS})
    return {k: v for k, v in flat.items() if is_result_key(k)}


def config_fingerprint(config: dict) -> str:
    """A short hash of :func:`result_settings` (equal configs, equal fingerprints)."""
    text = json.dumps(result_settings(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _show(value) -> str:
    """A value as it is written on the command line (``0.05``, ``true``, ``null``, ``[1, 2]``)."""
    return str(value) if isinstance(value, str | int | float) and not isinstance(
        value, bool) else json.dumps(value)


def differences(before: dict, after: dict) -> list[str]:
    """``key: old → new`` for every differing key of two flat dicts (``—``: absent)."""
    lines = []
    for key in sorted(before.keys() | after.keys()):
        if before.get(key, KeyError) != after.get(key, KeyError):
            old = _show(before[key]) if key in before else "—"
            new = _show(after[key]) if key in after else "—"
            lines.append(f"{key}: {old} → {new}")
    return lines


# --------------------------------------------------------------------------- reading
def read_record(run_dir: Path) -> dict | None:
    """The run folder's ``config.yaml`` as plain data, or None when it has none. A folder is a
    run folder only when its ``config.yaml`` has the ``provenance`` (with a ``fingerprint``)
    that ``muoneq train`` writes: any other ``config.yaml`` raises :class:`RunFolderError`, so
    that a run never takes over, clears or overwrites a folder it did not make."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")  # unreadable: one line by the command (no_access)
    try:
        document = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception:  # not YAML, or not a mapping: not one of ours either
        document = None
    provenance = document.get("provenance") if isinstance(document, dict) else None
    if not isinstance(provenance, dict) or "fingerprint" not in provenance:
        raise RunFolderError(
            f"{run_dir} holds a {CONFIG_FILE} that muoneq train did not write (no provenance), "
            "so it is not a run folder and is left alone; choose another run.dir or run.name")
    return document


def schema_default(cfg: DictConfig, key: str):
    """The default the dataclass schema of ``cfg`` gives the flat ``key`` (enums by name), or
    :data:`KeyError` (the class, as a marker) when it gives none."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return KeyError
    for f in dataclasses.fields(schema):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                return KeyError
            return value.name if isinstance(value, enum.Enum) else value
    return KeyError


def changed_settings(record: dict, cfg: DictConfig, world_size: int | None = None) -> list[str]:
    """``key: old → new`` for every key that can change the result and differs between the run
    recorded in ``record`` (a ``config.yaml``) and ``cfg`` (a key newer than the run counts as
    equal at its schema default: module docstring); with ``world_size``, the number of
    processes too."""
    recorded, now = result_settings(record), result_settings(resolved(cfg))
    for key in now.keys() - recorded.keys():
        if now[key] == schema_default(cfg, key):
            recorded[key] = now[key]
    if world_size is not None:
        previous = (record.get("provenance") or {}).get("world_size")
        if previous is not None:
            recorded, now = {**recorded, "world_size": previous}, {**now, "world_size": world_size}
    return differences(recorded, now)


def check_same_run(run_dir: Path, record: dict, cfg: DictConfig, *, finished: bool,
                   world_size: int | None = None) -> None:
    """Raise :class:`RunFolderError` unless ``cfg`` would compute what the run in ``run_dir``
    computed (every key that can change the result equal; the number of processes too, when
    ``world_size`` is given). The error has one detail line per differing key."""
    changed = changed_settings(record, cfg, world_size)
    if not changed:
        return
    keys = [line.split(":", 1)[0] for line in changed]
    if finished and set(keys) <= set(BUDGET_KEYS):
        raise RunFolderError(
            f"{run_dir} holds a finished run of another length ({', '.join(keys)} differ), and "
            "a finished run is not extended: its learning-rate schedule was annealed to its own "
            "end, so a longer run is a different run; start it in another folder (another "
            "run.dir or run.name), or restore the old value to read the finished run's results",
            details=changed,
        )
    shown = changed if len(changed) <= MAX_SHOWN else [
        *changed[:MAX_SHOWN], f"… and {len(changed) - MAX_SHOWN} more"]
    raise RunFolderError(
        f"{run_dir} was run with other settings ("
        f"{'1 key below differs' if len(changed) == 1 else f'{len(changed)} keys below differ'}"
        "), so resume=auto cannot "
        f"{'reuse its results' if finished else 'continue it'}; restore those values to "
        f"{'read' if finished else 'continue'} that run, or start a new one in another folder "
        "(another run.dir or run.name)",
        details=shown,
    )


# --------------------------------------------------------------------------- writing
def session(argv: list[str] | None = None, resolved: dict | None = None) -> dict:
    """Who runs this session: package version, the version of the code it imported (its git
    commit and dirty state, and the warm server it was forked from, if any:
    :mod:`muoneq.suite.code_version`), command line, host, start time, and what the config's
    ``auto`` values became on its machine (``resolved``, e.g. the ``ns_dtype`` Newton–Schulz ran
    in)."""
    import lightning

    code = code_version.taken()
    return {
        "muoneq_version": muoneq.__version__,
        "git_commit": code.commit,
        "git_dirty": code.dirty,
        **({"forked_from": {**code.forked_from, "git_commit": code.commit,
                            "git_dirty": code.dirty}} if code.forked_from else {}),
        "command": " ".join(["muoneq", "train", *argv]) if argv is not None else " ".join(sys.argv),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "lightning": lightning.__version__,
        **({"resolved": resolved} if resolved else {}),
    }


def write_new(run_dir: Path, cfg: DictConfig, argv: list[str] | None, world_size: int,
              auto: dict | None = None) -> None:
    """``config.yaml`` of a run that starts now (``auto``: what ``auto`` values resolved to)."""
    config = resolved(cfg)
    provenance = {**session(argv, auto), "fingerprint": config_fingerprint(config),
                  "world_size": world_size, STAMPED: True, "resumed": []}
    _write(run_dir, {**config, "provenance": provenance})


def add_session(run_dir: Path, record: dict, cfg: DictConfig, argv: list[str] | None,
                checkpoint: Path, auto: dict | None = None) -> None:
    """Record a session that continues the run from ``checkpoint``. The run config stays as it
    was; keys that cannot change the result and were changed are listed in the entry."""
    recorded = flatten({k: v for k, v in record.items() if k not in RECORD_KEYS})
    changed = differences(recorded, flatten(resolved(cfg)))
    entry = {**session(argv, auto), "from_checkpoint": checkpoint.name, "changed": changed}
    provenance = dict(record.get("provenance") or {})
    provenance["resumed"] = [*(provenance.get("resumed") or []), entry]
    _write(run_dir, {**record, "provenance": provenance})


def _write(run_dir: Path, document: dict) -> None:
    atomic_write(Path(run_dir) / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create(document)))
