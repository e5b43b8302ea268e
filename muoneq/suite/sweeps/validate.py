"""Check a sweep before it launches anything (and before its study is created): the preflight
(:func:`preflight`) that ``--dry-run`` and every start of the sweep run alike.

An existing study must have been started with the same fixed settings
(:func:`muoneq.suite.sweeps.study.check_study_fingerprint`: a changed objective is refused before
anything else). When the launch command runs ``muoneq train``, every point's training config is
composed and type-checked exactly as that command will (:func:`muoneq.suite.runtime.config.compose`,
without training), and the first bad point stops the sweep with its key and the config error; the
objective, and every metric the ``report:`` section names, must be a key of the ``metrics.json`` its
task writes (:func:`muoneq.suite.runtime.metrics.metric_keys`), or the sweep stops naming the key,
the closest one and the list; the data a point's runs read must be usable (its task's
``check_data``, from file headers: a validation split shorter than ``task.data.val_tokens`` stops
the sweep in one line; data not found on this machine is logged, since the machines that run the
trials may hold it). Run folders that already hold a run (a ``config.yaml``) are compared
with the config their point gives now: a changed experiment file or override never reuses, or
continues, a run made with other settings. For an open (TPE) search, every search parameter is
checked at its low and high bounds (every choice of a categorical one), with the others at their low
bound or first choice; for a coordinate descent, every value of every axis with the others at the
start. Bracketing checks each value it would add the same way before adding it
(:func:`point_check`).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from muoneq.suite.errors import DataError, UserError
from muoneq.suite.sweeps.launch import trial_command
from muoneq.suite.sweeps.report_spec import metrics_named
from muoneq.suite.sweeps.spec import Point, SweepError, SweepSpec, format_value
from muoneq.suite.sweeps.study import check_study_fingerprint, existing_study

log = logging.getLogger("muoneq.suite.sweeps")

#: the words that start the training command in a trial's argv (``… -m muoneq train …``)
TRAIN_COMMAND = ("muoneq", "train")


def training_args(argv: Sequence[str]) -> list[str] | None:
    """The ``muoneq train`` arguments of a trial's command, or None when it runs something
    else (the sweep can then check nothing before launching)."""
    for i in range(1, len(argv)):
        if (Path(argv[i - 1]).name, argv[i]) == TRAIN_COMMAND:
            return [a for a in argv[i + 1:] if not a.startswith("--")]
    return None


def search_points(spec: SweepSpec) -> Iterator[Point]:
    """The points an open search's check composes (module docstring)."""
    params, coordinate = spec.search.params, spec.search.type == "coordinate"
    seen = set()
    if coordinate:
        first = {n: spec.search.start[n] for n in params}
        start = Point(tuple(first.items()))
        seen.add(start.key)
        yield start
    else:
        first = {n: p.choices[0] if p.type == "categorical" else p.low for n, p in params.items()}
    for name, p in params.items():
        values = (p.values if coordinate else
                  p.choices if p.type == "categorical" else [p.low, p.high])
        for value in values:
            if p.type == "int" and not coordinate:
                value = int(value)
            point = Point(tuple((n, value if n == name else first[n]) for n in params))
            if point.key not in seen:
                seen.add(point.key)
                yield point


def preflight(spec: SweepSpec, url: str | None, study_dir: Path) -> int:
    """Everything checked before a sweep starts or in ``--dry-run`` (module docstring); creates
    nothing. Returns the number of training configs composed (:func:`check_trials`)."""
    found = existing_study(spec, url, study_dir)
    if found is not None:
        check_study_fingerprint(spec, found[0], url, study_dir)
    return check_trials(spec, study_dir)


def check_metrics(spec: SweepSpec, cfg, point: Point) -> None:
    """:class:`SweepError` when the objective or a metric of the report is not a number of the
    ``metrics.json`` that ``cfg`` (``point``'s config) writes on this machine (a misspelled key,
    text such as ``git_commit``, MFU on a CPU); nothing when its task declares no keys."""
    from muoneq.suite.runtime.metrics import METRICS_FILE, TEXT_KEYS, metric_keys

    keys = metric_keys(cfg)
    if keys is None:
        return
    numbers = [k for k in keys if k not in TEXT_KEYS]
    named = {spec.objective.metric: "objective.metric", **metrics_named(spec.report)}
    for metric, field in named.items():
        if metric in numbers:
            continue
        hint = difflib.get_close_matches(metric, numbers, n=1, cutoff=0.6)
        what = ("is text, not a number, in" if metric in keys else
                "is not a key of")
        raise SweepError(
            f"{field}={metric!r} {what} the {METRICS_FILE} a run of point {point.key!r} writes "
            f"on this machine (task {cfg.task.name})"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f"; its numeric keys: {', '.join(numbers)}")


def check_data(cfg, point: Point, checked: set[str]) -> None:
    """:class:`SweepError` when the data a run of ``point`` (its config ``cfg``) reads is
    unusable (its task's ``check_data``: a validation split shorter than ``val_tokens``, say),
    once per distinct ``task`` config (``checked``). Data not found on this machine is only
    logged: the machines that run the trials may hold it (an ``srun`` launch), and a trial
    without it stops with status 2, never retried."""
    from omegaconf import OmegaConf

    from muoneq.suite.runtime.tasks import get_task

    check = get_task(cfg.task.name).check_data
    key = OmegaConf.to_yaml(cfg.task)
    if check is None or key in checked:
        return
    checked.add(key)
    try:
        check(cfg)
    except DataError as err:
        log.warning("not on this machine (the machines that run the trials of point %s need "
                    "it): %s", point.key, err)
    except UserError as err:
        raise SweepError(f"point {point.key!r}: {err}") from None


def check_trials(spec: SweepSpec, study_dir: Path) -> int:
    """Compose the training config of every point (grid) or of the search's bounds (TPE) and
    compare existing run folders with it; raise :class:`SweepError` at the first problem.
    Returns the number of configs composed (0 when the launch command does not run
    ``muoneq train``)."""
    from muoneq.suite.runtime import record

    points = spec.points() if spec.is_grid else list(search_points(spec))
    check_folder_names(points)
    checked = value_cover(points) if spec.is_grid else {p.key for p in points}
    cache: dict = {}
    data_checked: set[str] = set()
    composed = 0
    for point in points:
        for i, seed in enumerate(spec.seeds):
            run_dir = point.run_dir(study_dir, seed)
            saved = record.read_record(run_dir)
            if (i or point.key not in checked) and saved is None:
                continue  # one seed, and each value of each config shape, type-checks it
            try:
                cfg = compose_point(spec, point, seed, run_dir, cache)
            except UserError as err:
                raise SweepError(
                    f"point {point.key!r} (seed {seed}) is not a valid training config: {err}; "
                    "fix the sweep's overrides or grid (--dry-run checks them all)") from None
            if cfg is None:
                return 0
            check_metrics(spec, cfg, point)
            check_data(cfg, point, data_checked)
            composed += 1
            changed = [] if saved is None else record.changed_settings(saved, cfg)
            if changed:
                raise SweepError(
                    f"{run_dir} holds a run of point {point.key!r} (seed {seed}) made with other "
                    "settings, which this sweep would reuse or continue; restore the experiment "
                    f"file or overrides it was run with, give the study another name (--set "
                    f"study=NAME), or delete that run folder", details=changed)
    return composed


def value_cover(points: Sequence[Point]) -> set[str]:
    """The keys of the grid points that, in order, bring a value of an axis not composed yet
    within their config shape (the same group choices, ``experiment=…``, ``optimizer=…``, and the
    same axes): so every value of every axis is composed once in each shape, and a grid of
    10 × 10 × 10 points of one shape composes 28 configs, not 1,000."""
    from muoneq.suite.runtime.config import GROUPS

    seen: set = set()
    keys = set()
    for point in points:
        values = point.as_dict()
        shape = (tuple((a, format_value(v)) for a, v in point.items if a in GROUPS),
                 tuple(values))
        new = {(shape, a, format_value(v)) for a, v in point.items} - seen
        if new:
            keys.add(point.key)
            seen |= new
    return keys


def check_folder_names(points: Sequence[Point]) -> None:
    """:class:`SweepError` when two points would share a run folder: their values differ only in
    characters a folder name cannot hold (``a/b`` and ``a_b``), so the second could never run."""
    folders: dict[str, str] = {}
    for point in points:
        first = folders.setdefault(point.slug(), point.key)
        if first != point.key:
            raise SweepError(
                f"points {first!r} and {point.key!r} would share the run folder "
                f"trials/{point.slug()}/ (their values differ only in characters a folder name "
                "cannot hold), so the second could never run; change one of the values (a "
                "symbolic link or a copy of the file under another name, say)")


def compose_point(spec: SweepSpec, point: Point, seed: int, run_dir: Path, cache: dict):
    """The training config ``point`` with ``seed`` runs with (raises the config's
    :class:`UserError`), or None when the launch command does not run ``muoneq train``."""
    from muoneq.suite.runtime.config import compose

    argv, _, _ = trial_command(spec, point, seed, run_dir)
    args = training_args(argv)
    return None if args is None else compose(args, cache=cache)


def point_check(spec: SweepSpec, study_dir: Path) -> Callable[[Point], str | None]:
    """``check(point)``: why ``point`` is not a valid training config (the config error's
    text), or None; for the values bracketing would add (:data:`muoneq.suite.sweeps.plan.Check`)."""
    cache: dict = {}
    seen: dict[str, str | None] = {}

    def check(point: Point) -> str | None:
        if point.key not in seen:
            seed = spec.seeds[0]
            try:
                compose_point(spec, point, seed, point.run_dir(study_dir, seed), cache)
                seen[point.key] = None
            except UserError as err:
                seen[point.key] = str(err)
        return seen[point.key]

    return check
