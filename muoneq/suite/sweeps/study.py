"""Open (or create) the Optuna study of a sweep, on a storage opened here, or find an existing
one without creating anything (:func:`existing_study`, for ``--status`` and ``--dry-run``).

A study keeps the settings it started with: its experiment, fixed overrides, objective, launch
command and kind (grid or search) are recorded as its ``fingerprint``
(:func:`study_fingerprint`) and a later driver with other values is refused (the grid and the
seeds may grow; :func:`check_study_fingerprint`). The sweep spec is saved with the study
(``study.user_attrs["spec"]`` and ``<study>/sweep.yaml``) for ``muoneq report``, and so are
its axes' Optuna distributions (:mod:`muoneq.suite.sweeps.distributions`) and the objective's
name (``study.set_metric_names``: Optuna's dashboard and plots say ``val/ppl``, not
"Objective 0").
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import optuna
from omegaconf import OmegaConf
from optuna.storages import BaseStorage

from muoneq.suite.sweeps import distributions
from muoneq.suite.sweeps.spec import SweepError, SweepSpec, spec_to_dict
from muoneq.suite.sweeps.storage import JOURNAL_NAME, open_storage, storage_label
from muoneq.suite.sweeps.trial_record import STUDY_DISTRIBUTIONS, STUDY_FINGERPRINT, STUDY_SPEC


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


def study_fingerprint(spec: SweepSpec) -> dict:
    """What may not change while a study goes on (the grid and seeds may grow)."""
    return {"experiment": spec.experiment, "overrides": list(spec.overrides),
            "objective": [spec.objective.metric, spec.objective.direction],
            "command": spec.launch.command,
            "kind": {"grid": "grid", "tpe": "search"}.get(spec.kind, spec.kind)}


def existing_study(spec: SweepSpec, url: str | None,
                   study_dir: Path) -> tuple[optuna.Study, BaseStorage] | None:
    """The sweep's study and its storage when the study exists, else None; creates nothing
    (no study folder, no journal file, no study)."""
    if (url is None or url.startswith("journal:")) and not (
            Path(url[len("journal:"):]) if url else Path(study_dir) / JOURNAL_NAME).exists():
        return None
    storage = open_storage(url, study_dir)
    try:
        return optuna.load_study(study_name=spec.study, storage=storage), storage
    except KeyError:
        return None


def check_study_fingerprint(spec: SweepSpec, study: optuna.Study, url: str | None,
                            study_dir: Path) -> None:
    """:class:`SweepError` when ``study`` was started with other fixed settings than
    ``spec``'s (a study not yet fingerprinted passes)."""
    recorded = study.user_attrs.get(STUDY_FINGERPRINT)
    mine = json.loads(json.dumps(study_fingerprint(spec)))
    if recorded is None or recorded == mine:
        return
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
    check_study_fingerprint(spec, study, url, study_dir)
    if study.metric_names != [spec.objective.metric]:  # Optuna's views name it so
        with warnings.catch_warnings():  # experimental since Optuna 3.2, unchanged since
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([spec.objective.metric])
    if STUDY_FINGERPRINT not in study.user_attrs:
        study.set_user_attr(STUDY_FINGERPRINT, json.loads(json.dumps(study_fingerprint(spec))))
    if spec.planned:
        recorded = study.user_attrs.get(STUDY_DISTRIBUTIONS)
        merged = distributions.to_json(distributions.merge(
            distributions.from_json(recorded), distributions.spec_distributions(spec)))
        if merged != recorded:
            study.set_user_attr(STUDY_DISTRIBUTIONS, merged)
    study.set_user_attr(STUDY_SPEC, spec_to_dict(spec))
    (study_dir / "sweep.yaml").write_text(OmegaConf.to_yaml(spec_to_dict(spec)))
    return study, storage
