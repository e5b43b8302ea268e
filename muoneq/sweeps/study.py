"""Open (or create) the Optuna study of a sweep, on a storage opened here.

A study keeps the settings it started with: its experiment, fixed overrides, objective, launch
command and kind (grid or search) are recorded as its ``fingerprint`` and a later driver with
other values is refused (the grid and the seeds may grow). The sweep spec is saved with the
study (``study.user_attrs["spec"]`` and ``<study>/sweep.yaml``) for ``muoneq report``.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from omegaconf import OmegaConf
from optuna.storages import BaseStorage

from muoneq.sweeps.spec import SweepError, SweepSpec, spec_to_dict
from muoneq.sweeps.storage import open_storage, storage_label


def sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler | None:
    """TPE over an open search's parameters; None (Optuna's default, never consulted) for a
    grid or a coordinate descent, whose points the driver chooses from its plan: Optuna's
    ``GridSampler`` keeps its grid as one categorical parameter, and a categorical's choices
    may not change within a study ("CategoricalDistribution does not support dynamic value
    space"), so a grid it sampled could never grow, by bracketing or by an edited sweep file."""
    if spec.planned:
        return None
    s = spec.search
    return optuna.samplers.TPESampler(seed=s.sampler_seed, n_startup_trials=s.n_startup_trials)


def pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.prune
    if not p.enabled:
        return optuna.pruners.NopPruner()
    if p.pruner == "median":
        return optuna.pruners.MedianPruner(p.n_startup_trials, p.n_warmup_steps)
    if p.pruner == "percentile":
        return optuna.pruners.PercentilePruner(p.percentile, p.n_startup_trials, p.n_warmup_steps)
    if p.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.HyperbandPruner()


def fingerprint(spec: SweepSpec) -> dict:
    """What may not change while a study goes on (the grid and seeds may grow)."""
    return {"experiment": spec.experiment, "overrides": list(spec.overrides),
            "objective": [spec.objective.metric, spec.objective.direction],
            "command": spec.launch.command,
            "kind": {"grid": "grid", "tpe": "search"}.get(spec.kind, spec.kind)}


def open_study(spec: SweepSpec, url: str | None,
               study_dir: Path) -> tuple[optuna.Study, BaseStorage]:
    """The sweep's study on the storage ``url`` names (:func:`open_storage`), and that storage;
    :class:`SweepError` when the study was started with other fixed settings."""
    study_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(url, study_dir)
    study = optuna.create_study(
        study_name=spec.study, storage=storage, sampler=sampler(spec), pruner=pruner(spec),
        direction=spec.objective.direction, load_if_exists=True,
    )
    recorded = study.user_attrs.get("fingerprint")
    mine = json.loads(json.dumps(fingerprint(spec)))
    if recorded is None:
        study.set_user_attr("fingerprint", mine)
    elif recorded != mine:
        changed = sorted(k for k in mine if recorded.get(k) != mine[k])
        where = storage_label(url, study_dir)
        delete = (f"delete it (rm -r {study_dir})" if url is None else
                  f"delete it (optuna delete-study --study-name {spec.study} --storage "
                  f"{where}, and rm -r {study_dir})")
        raise SweepError(
            f"study {spec.study!r} in {where} was created with other "
            f"{', '.join(changed)} (below), and a study keeps the settings it started with; "
            "restore them (the sweep file, --set and --override), give this sweep a new "
            f"study name (--set study=NAME), or {delete} to start over",
            details=[f"{k}: {recorded.get(k)!r} → {mine[k]!r}" for k in changed],
        )
    study.set_user_attr("spec", spec_to_dict(spec))
    (study_dir / "sweep.yaml").write_text(OmegaConf.to_yaml(spec_to_dict(spec)))
    return study, storage
