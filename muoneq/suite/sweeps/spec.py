"""The sweep file: a typed OmegaConf schema, its validation, and the runs it describes.

A sweep file (``sweeps/*.yaml``) names the experiment, the fixed training overrides, the search
space (a grid given as a union of product blocks, optionally grown until it brackets every
optimum; a coordinate descent; or an open TPE search), the seeds (an axis of their own, never
optimized), the objective metric from each run's ``metrics.json``, the launch template and the
retry/pruning budget. ``load_sweep(path, dotlist)`` returns a
:class:`SweepSpec`; misspelled keys and wrong types are errors that name the key.

A *point* is one assignment of the search axes (``optimizer=muon_nes optimizer.lr=0.002``);
a *run* is one process: a point with one seed.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import shlex
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from itertools import product
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from muoneq.suite.errors import UserError
from muoneq.suite.folders import suite_folder
from muoneq.suite.runtime.config.schema import MAX_NAME_BYTES
from muoneq.suite.sweeps.report_spec import DIRECTIONS, ReportSpec, check_report

#: The default trial command (the runtime's CLI). ``{overrides}`` expands to one token per
#: ``key=value`` (fixed overrides first, then the point's axes); ``resume=auto`` lets a retried
#: run continue from its last checkpoint in the same run folder.
DEFAULT_COMMAND = (
    "{python} -m muoneq train experiment={experiment} {overrides} seed={seed} "
    "run.dir={run_dir} resume=auto"
)
#: Placeholders every command template may use (plus the sweep's ``launch.vars``).
PLACEHOLDERS = (
    "python", "experiment", "overrides", "seed", "run_dir", "study", "trial", "nproc",
    "devices", "worker",
)
#: ``launch.warm``: fork trials from a server that imported once
#: (:func:`muoneq.suite.sweeps.launch.warm_module`)
WARM_CHOICES = ("auto", "true", "false")
PRUNERS = ("median", "percentile", "successive_halving", "hyperband")
PARAM_TYPES = ("float", "int", "categorical")
SEARCH_TYPES = ("tpe", "coordinate")
SCALES = ("auto", "log", "linear")


class SweepError(UserError, ValueError):
    """A sweep file or its overrides are invalid (the message names the field)."""


# ---------------------------------------------------------------- the schema (structured configs)
# (its ``report:`` section: :mod:`muoneq.suite.sweeps.report_spec`)
@dataclass
class Objective:
    metric: str = MISSING  #: key of ``metrics.json`` told to Optuna
    direction: str = "minimize"  #: ``minimize`` or ``maximize``


@dataclass
class Launch:
    #: command template (shell words; see :data:`PLACEHOLDERS`); ``torchrun``/``srun`` welcome
    command: str = DEFAULT_COMMAND
    nproc: int = 1  #: value of ``{nproc}`` (processes per trial, e.g. GPUs for torchrun)
    devices_per_trial: int = 0  #: accelerators each trial gets (0: leave visibility alone)
    device_env: str = "CUDA_VISIBLE_DEVICES"  #: e.g. ASCEND_RT_VISIBLE_DEVICES on Ascend
    env: dict[str, str] = field(default_factory=dict)  #: extra environment for the trial
    vars: dict[str, Any] = field(default_factory=dict)  #: extra placeholders, e.g. ``nodes``
    timeout_s: float | None = None  #: kill a run after this many seconds (counts as a failure)
    #: ``auto``: trials of the default command are forked by a server that imported the runtime
    #: once (:mod:`muoneq.suite.sweeps.warm`), others spawned; ``true``: also a command of the
    #: form ``{python} -m MODULE …``; ``false``: every trial is spawned as its command
    warm: str = "auto"


@dataclass
class Retry:
    max_retries: int = 2  #: a failed run is re-run at most this many times
    heartbeat_s: float = 30.0  #: how often a driver marks its running trials alive
    stale_after_s: float = 300.0  #: a trial of another machine without heartbeat is dead after


@dataclass
class Prune:
    enabled: bool = False
    tag: str = "val/loss"  #: TensorBoard scalar reported by global step (rank 0 writes it)
    pruner: str = "median"  #: one of :data:`PRUNERS`
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    percentile: float = 25.0  #: for ``pruner: percentile``
    poll_s: float = 30.0  #: how often the event files are read


@dataclass
class SearchParam:
    type: str = "float"  #: TPE: float, int or categorical
    low: float | None = None  #: TPE
    high: float | None = None  #: TPE
    log: bool = False  #: TPE
    choices: list[Any] | None = None  #: TPE, categorical
    values: list[Any] | None = None  #: coordinate descent: the axis' grid


@dataclass
class Search:
    """An open search: TPE (each trial runs every seed and is told their mean), or coordinate
    descent (:mod:`muoneq.suite.sweeps.plan`; one trial per run, as a grid)."""

    type: str = "tpe"  #: one of :data:`SEARCH_TYPES`
    params: dict[str, SearchParam] = field(default_factory=dict)
    n_trials: int = 20  #: TPE
    sampler_seed: int | None = None  #: TPE
    n_startup_trials: int = 10  #: TPE
    start: dict[str, Any] = field(default_factory=dict)  #: coordinate: every axis' first value
    threshold: float = 0.0  #: coordinate: a move must improve by more than this (relative)
    max_cycles: int = 3  #: coordinate: passes over the axes at most


@dataclass
class Bracket:
    """Grow a grid until each family's best value is interior (:mod:`muoneq.suite.sweeps.plan`)."""

    axes: list[str] = field(default_factory=lambda: ["optimizer.lr"])
    max_extensions: int = 4  #: values added per family and axis at most
    scale: dict[str, str] = field(default_factory=dict)  #: axis → auto, log or linear
    bounds: dict[str, list[float]] = field(default_factory=dict)  #: axis → [low, high]


@dataclass
class Mini:
    """The study in miniature (``muoneq sweep NAME --mini``, ``make NAME MINI=1``): the same
    objective, search axes and report, as the study ``<study>-mini``, on a laptop's CPU in
    minutes (:mod:`muoneq.suite.sweeps.miniature`). Each field given replaces the sweep's."""

    experiment: str | None = None  #: the tiny model's experiment (a grid axis: in ``grid``)
    overrides: list[str] = field(default_factory=list)  #: replace the sweep's fixed overrides
    seeds: list[int] | None = None
    grid: list[dict[str, Any]] = field(default_factory=list)  #: the sweep's axes, fewer values
    #: bracketing adds at most this many values per family and axis (its bound in miniature)
    max_extensions: int = 1
    shows: str = ""  #: what the miniature shows, one sentence (its report's description)


#: the suffix of a miniature's study name
MINI_SUFFIX = "-mini"


@dataclass
class SweepSpec:
    study: str = MISSING  #: study name (also the folder under the runs directory)
    description: str = ""
    experiment: str | None = None  #: experiment config; or an ``experiment`` grid axis
    overrides: list[str] = field(default_factory=list)  #: fixed ``key=value`` for every run
    seeds: list[int] = field(default_factory=lambda: [0])
    grid: list[dict[str, Any]] = field(default_factory=list)  #: union of product blocks
    search: Search | None = None
    bracket: Bracket | None = None  #: grids only
    objective: Objective = field(default_factory=Objective)
    launch: Launch = field(default_factory=Launch)
    retry: Retry = field(default_factory=Retry)
    prune: Prune = field(default_factory=Prune)
    report: ReportSpec = field(default_factory=ReportSpec)
    mini: Mini | None = None  #: the study in miniature (``--mini``)

    # ------------------------------------------------------------------------- derived views
    @property
    def is_grid(self) -> bool:
        return bool(self.grid)

    @property
    def kind(self) -> str:
        """``grid``, ``coordinate`` or ``tpe``."""
        return "grid" if self.grid else self.search.type

    @property
    def planned(self) -> bool:
        """One trial per run, the points from :func:`muoneq.suite.sweeps.plan.make_plan` (a grid or
        a coordinate descent); else TPE chooses configurations, each run on every seed."""
        return self.kind != "tpe"

    def axes(self) -> list[str]:
        """Search axes in order of first appearance (``seed`` excluded)."""
        if self.search is not None:
            return list(self.search.params)
        seen: dict[str, None] = {}
        for block in self.grid:
            seen.update(dict.fromkeys(block))
        return list(seen)

    def points(self) -> list[Point]:
        """Every point of the grid as written (blocks expanded, duplicates across blocks kept
        once); bracketing may add more (:mod:`muoneq.suite.sweeps.plan`)."""
        axes = self.axes()
        out: dict[str, Point] = {}
        for block in self.grid:
            keys = list(block)
            for values in product(*(block[k] for k in keys)):
                assignment = dict(zip(keys, values, strict=True))
                point = Point(tuple((a, assignment[a]) for a in axes if a in assignment))
                out.setdefault(point.key, point)
        return list(out.values())

    def experiment_of(self, point: Point) -> str:
        return str(point.as_dict().get("experiment", self.experiment))


@dataclass(frozen=True)
class Point:
    """One assignment of the search axes, in axis order."""

    items: tuple[tuple[str, Any], ...]

    @property
    def key(self) -> str:
        """Canonical text, e.g. ``optimizer=muon_nes optimizer.lr=0.002`` (the trial's id)."""
        return " ".join(f"{k}={format_value(v)}" for k, v in self.items)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def overrides(self) -> list[str]:
        """``key=value`` training overrides (``experiment`` goes to its own placeholder)."""
        return [f"{k}={format_value(v)}" for k, v in self.items if k != "experiment"]

    def run_dir(self, study_dir: Path, seed: int) -> Path:
        """The run folder of this point with ``seed``: ``<study>/trials/<slug>/seed<seed>``."""
        return Path(study_dir) / "trials" / self.slug() / f"seed{seed}"

    def slug(self) -> str:
        """A folder name for the point: readable, filesystem-safe, unique."""
        return folder_name(self.key.replace(" ", ","), self.key)


def folder_name(text: str, identity: str | None = None) -> str:
    """``text`` as one filesystem-safe folder name: characters other than ``A-Za-z0-9_.,=+-``
    replaced, and a name over 120 characters cut to 100 plus a digest of ``identity`` (default
    ``text``), so that two long names stay apart."""
    name = re.sub(r"[^A-Za-z0-9_.,=+-]+", "_", text) or "default"
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha1((identity or text).encode()).hexdigest()[:10]}"
    return name


def format_value(value: Any) -> str:
    """How a value is written in an override and a key (``repr`` for floats: exact)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# ------------------------------------------------------------------------------------ loading
def shipped_sweep(name: str | Path) -> Path | None:
    """The sweep file muoneq ships under the name ``name`` (``ablation-cifar10``, with or
    without ``.yaml``), or None."""
    name = Path(name)
    if len(name.parts) != 1 or name.suffix not in ("", ".yaml"):
        return None
    path = suite_folder("sweeps") / f"{name.stem}.yaml"
    return path if path.is_file() else None


def sweep_path(target: str | Path) -> Path:
    """A sweep file given by its path, or by the name of one muoneq ships."""
    path = Path(target)
    if path.is_file():
        return path
    shipped = shipped_sweep(path)
    if shipped is None:
        names = ", ".join(sorted(p.stem for p in suite_folder("sweeps").glob("*.yaml")))
        raise SweepError(f"sweep file not found: {path}; give a path to a sweep file or the "
                         f"name of one muoneq ships: {names or '(none)'}")
    return shipped


def load_sweep(path: str | Path, dotlist: Sequence[str] = (), mini: bool = False) -> SweepSpec:
    """Read a sweep file (a path, or the name of a shipped one: :func:`sweep_path`), take its
    miniature with ``mini`` (:func:`miniature`), apply ``dotlist`` overrides (``seeds=[0]``),
    validate, return it."""
    path = sweep_path(path)
    try:
        raw = OmegaConf.load(path)
    except UnicodeDecodeError as err:
        raise SweepError(f"{path}: byte {err.start} is not UTF-8 ({err.reason}), so the file is "
                         "not a sweep file (YAML in UTF-8); save it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise SweepError(f"{path}: {where}{problem}, so the file is not valid YAML; fix it "
                         "there (indentation, a missing ':' or an unclosed bracket or quote)"
                         ) from None
    except OSError as err:  # OmegaConf's word for a document that is one value (7, true)
        if err.errno is not None:
            raise  # unreadable: said by the command
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, DictConfig):
        kind = type(raw).__name__.removesuffix("Config").lower()
        kind = {"int": "number", "float": "number", "bool": "boolean"}.get(kind, kind)
        raise SweepError(f"{path}: the file holds a {kind} at its top level, and a sweep file is "
                         "a mapping of its fields (study:, grid: or search:, objective: …); see "
                         "sweeps/*.yaml")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepSpec), raw)
    except OmegaConfBaseException as err:
        raise schema_error(err, str(path)) from None
    if mini:
        spec = OmegaConf.to_object(merged)
        validate(spec, source=str(path))  # the sweep as written, its mini: section included
        merged = OmegaConf.merge(OmegaConf.structured(SweepSpec),
                                 spec_to_dict(miniature(spec, str(path))))
    for item in dotlist:
        merged = _set(merged, item, path)
    try:
        spec = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise schema_error(err, f"{path} with --set {' '.join(dotlist)}") from None
    validate(spec, source=str(path))
    return spec


def _set(merged, item: str, path: Path):
    """``merged`` with one ``--set key=value``; a list given without brackets (``seeds=0,1``)
    or a value that is not YAML is one line saying how lists are written."""
    key, _, value = item.partition("=")
    lists = "write a list in brackets, quoted for the shell: --set '{key}=[{values}]'"
    try:
        return OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise SweepError(f"{path} with --set {item}: the value is not valid YAML ({problem}); "
                         + lists.format(key=key, values=value.strip("[]"))) from None
    except OmegaConfBaseException as err:
        try:
            is_list = isinstance(OmegaConf.select(merged, key), ListConfig)
        except OmegaConfBaseException:
            is_list = False
        if is_list:
            raise SweepError(f"{path} with --set {item}: {key} is a list; "
                             + lists.format(key=key, values=value)) from None
        raise schema_error(err, f"{path} with --set {item}") from None


def spec_from_dict(data: dict, source: str = "<dict>") -> SweepSpec:
    """Build and validate a spec from a plain dict (used for the copy saved with a study)."""
    try:
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SweepSpec), data))
    except OmegaConfBaseException as err:
        raise schema_error(err, source) from None
    validate(spec, source=source)
    return spec


def miniature(spec: SweepSpec, source: str) -> SweepSpec:
    """The sweep's study in miniature (:class:`Mini`): ``<study>-mini``, with the fields its
    ``mini:`` section gives, bracketing bounded by ``mini.max_extensions``, a description that
    says it is a miniature and what it shows, and no ``mini:`` section of its own."""
    m = spec.mini
    if m is None:
        raise SweepError(f"{source}: no 'mini:' section, so no miniature of study {spec.study}; "
                         "the sweeps muoneq ships each have one (docs/sweeps.md)")
    data = spec_to_dict(spec)
    data.update(study=f"{spec.study}{MINI_SUFFIX}", mini=None,
                description=f"Miniature of {spec.study} ({spec.description}). {m.shows}".strip(),
                experiment=m.experiment or spec.experiment, overrides=list(m.overrides),
                seeds=list(m.seeds or spec.seeds), grid=data["mini"]["grid"] or data["grid"])
    if spec.bracket is not None:
        data["bracket"]["max_extensions"] = min(spec.bracket.max_extensions, m.max_extensions)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SweepSpec), data))
    except OmegaConfBaseException as err:
        raise schema_error(err, f"{source} (its mini: section)") from None


#: options of ``muoneq sweep`` that are no field of the sweep file (``--set workers=3``)
CLI_OPTIONS = ("workers", "devices", "storage", "runs_dir", "poll", "dry_run", "status")


def schema_error(err: OmegaConfBaseException, source: str) -> SweepError:
    """One line naming the key: an unknown one with the closest known key and the allowed
    ones (as training configs say it), any other with OmegaConf's first line."""
    key = getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if not isinstance(err, ConfigKeyError):
        return SweepError(f"{source}: {key}: {first}")
    parent, _, name = key.rpartition(".")
    owner = getattr(err, "object_type", None)  # the schema dataclass the key is not a field of
    allowed = sorted(f.name for f in fields(owner)) if is_dataclass(owner) else []
    hint = difflib.get_close_matches(name, allowed, n=1)
    if owner is SweepSpec and name.replace("-", "_") in CLI_OPTIONS:
        advice = f"; {name} is an option of the command: --{name.replace('_', '-')}"
    else:
        advice = f"; did you mean {hint[0]!r}?" if hint else ""
    where = f" of {parent or owner.__name__}" if owner is not SweepSpec and allowed else ""
    return SweepError(f"{source}: unknown key {key!r}{advice}; allowed keys{where}: "
                      f"{', '.join(allowed) or '(none)'}")


def spec_to_dict(spec: SweepSpec) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(spec), resolve=True)


def _choice(value: Any, allowed: Iterable[str], name: str, source: str) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise SweepError(f"{source}: {name}={value!r} is invalid; allowed: {', '.join(allowed)}")


def validate(spec: SweepSpec, source: str = "<sweep>") -> None:
    """Raise :class:`SweepError` naming the field for anything a run would trip over later."""
    _check_study(spec, source)
    _check_grid(spec.grid, source)
    if spec.search is not None:
        _check_search(spec.search, source)
    if spec.bracket is not None:
        _check_bracket(spec, source)
    _check_experiment(spec, source)
    _check_execution(spec, source)
    if spec.mini is not None:
        _check_mini(spec, source)
    try:
        check_report(spec.report, spec.axes())
    except ValueError as err:
        raise SweepError(f"{source}: {err}") from None


def _check_study(spec: SweepSpec, source: str) -> None:
    """The study's name, objective, kind (grid or search), seeds and overrides."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec.study):
        raise SweepError(f"{source}: study={spec.study!r} must be a folder name "
                         "(letters, digits, '_', '.', '-')")
    if len(spec.study.encode()) > MAX_NAME_BYTES:
        raise SweepError(f"{source}: study={spec.study[:40]}… is {len(spec.study.encode())} "
                         f"bytes, and a folder name holds at most {MAX_NAME_BYTES}; choose a "
                         "shorter study name")
    _choice(spec.objective.direction, DIRECTIONS, "objective.direction", source)
    if bool(spec.grid) == (spec.search is not None):
        raise SweepError(f"{source}: give exactly one of 'grid' (GridSampler) and "
                         "'search' (TPE)")
    if not spec.seeds or len(set(spec.seeds)) != len(spec.seeds):
        raise SweepError(f"{source}: seeds={spec.seeds} must be a non-empty list without repeats")
    from muoneq.suite.runtime.config.schema import check_seed

    for i, seed in enumerate(spec.seeds):
        try:
            check_seed(seed, f"seeds[{i}]")
        except ValueError as err:
            raise SweepError(f"{source}: {err}") from None
    for i, word in enumerate(spec.overrides):
        if "=" not in word or word.startswith("="):
            raise SweepError(f"{source}: overrides[{i}]={word!r} is not of the form key=value")


def _check_mini(spec: SweepSpec, source: str) -> None:
    """A miniature keeps the study's search axes (its grid, their values fewer) and bounds its
    bracketing; the miniature itself is checked as any sweep (:func:`miniature`)."""
    m = spec.mini
    if m.max_extensions < 1:
        raise SweepError(f"{source}: mini.max_extensions must be ≥ 1 (got {m.max_extensions})")
    if m.grid:
        if not spec.is_grid:
            raise SweepError(f"{source}: mini.grid is for a sweep with a grid; a search's "
                             "miniature keeps its search.params")
        _check_grid(m.grid, f"{source} mini")
        axes = list(dict.fromkeys(a for block in m.grid for a in block))
        if sorted(axes) != sorted(spec.axes()):
            raise SweepError(f"{source}: mini.grid's axes ({', '.join(axes)}) must be the "
                             f"sweep's ({', '.join(spec.axes())}): a miniature keeps the study's "
                             "shape, with fewer values")
    validate(miniature(spec, source), f"{source} (its mini: section)")


def _check_grid(grid: list[dict[str, Any]], source: str) -> None:
    """Every grid block non-empty, every axis but ``seed`` a list of scalar values."""
    for i, block in enumerate(grid):
        if not block:
            raise SweepError(f"{source}: grid[{i}] is empty")
        for axis, values in block.items():
            where = f"grid[{i}].{axis}"
            if axis == "seed":
                raise SweepError(f"{source}: {where}: seeds are their own axis; use 'seeds:'")
            _check_values(values, where, source)


def _check_experiment(spec: SweepSpec, source: str) -> None:
    """An experiment for every trial: at the top level, or on a grid axis reaching every point."""
    if spec.experiment is not None:
        return
    missing = [p.key for p in (spec.points() if spec.is_grid else [])
               if "experiment" not in p.as_dict()]
    if not spec.is_grid or missing:
        raise SweepError(f"{source}: 'experiment' is not set (top level or a grid axis)"
                         + (f"; points without it: {missing[:3]}" if missing else ""))


def _check_execution(spec: SweepSpec, source: str) -> None:
    """How trials run: retries, pruning, processes and the launch command."""
    r = spec.retry
    if r.max_retries < 0 or r.heartbeat_s <= 0 or r.stale_after_s <= r.heartbeat_s:
        raise SweepError(f"{source}: retry needs max_retries ≥ 0, heartbeat_s > 0 and "
                         "stale_after_s > heartbeat_s")
    _choice(spec.prune.pruner, PRUNERS, "prune.pruner", source)
    if spec.prune.poll_s <= 0:
        raise SweepError(f"{source}: prune.poll_s must be > 0")
    launch = spec.launch
    if launch.nproc < 1 or launch.devices_per_trial < 0:
        raise SweepError(f"{source}: launch.nproc must be ≥ 1 and devices_per_trial ≥ 0")
    check_template(launch.command, launch.vars, source)
    launch.warm = str(launch.warm).lower()  # YAML's true/false arrive as booleans
    _choice(launch.warm, WARM_CHOICES, "launch.warm", source)
    if launch.warm == "true" and module_of(launch.command) is None:
        raise SweepError(f"{source}: launch.warm=true forks trials of a command "
                         "`{python} -m MODULE …`, and launch.command is "
                         f"{launch.command!r}; set launch.warm=auto or false")


def module_of(command: str) -> str | None:
    """The module a launch template runs with this interpreter (``{python} -m MODULE …``), or
    None for any other command."""
    words = shlex.split(command)
    if len(words) < 3 or words[:2] != ["{python}", "-m"] or "{" in words[2]:
        return None
    return words[2]


def _check_search(search: Search, source: str) -> None:
    """The search's type, each of its axes, then its budget."""
    _choice(search.type, SEARCH_TYPES, "search.type", source)
    if not search.params:
        raise SweepError(f"{source}: search.params is empty")
    coordinate = search.type == "coordinate"
    for name, p in search.params.items():
        if coordinate:
            _check_coordinate_axis(search, name, source)
        else:
            _check_tpe_axis(p, f"search.params.{name}", source)
    if coordinate:
        extra = sorted(set(search.start) - set(search.params))
        if extra:
            raise SweepError(f"{source}: search.start.{extra[0]} is not a search axis; axes: "
                             f"{', '.join(search.params)}")
        if search.threshold < 0 or search.max_cycles < 1:
            raise SweepError(f"{source}: search needs threshold ≥ 0 and max_cycles ≥ 1 (got "
                             f"{search.threshold}, {search.max_cycles})")
    elif search.start:
        raise SweepError(f"{source}: search.start is for search.type=coordinate")
    elif search.n_trials < 1:
        raise SweepError(f"{source}: search.n_trials must be ≥ 1")


def _check_coordinate_axis(search: Search, name: str, source: str) -> None:
    """A coordinate-descent axis: a list of ``values`` and a start value."""
    p, where = search.params[name], f"search.params.{name}"
    if p.low is not None or p.high is not None or p.choices or p.log:
        raise SweepError(f"{source}: {where}: coordinate descent takes 'values' (a "
                         "list), not low/high/log/choices (those are TPE's)")
    _check_values(p.values, f"{where}.values", source)
    if name not in search.start:
        raise SweepError(f"{source}: search.start.{name} is missing: give the value "
                         "coordinate descent starts from on every axis")
    _check_values([search.start[name]], f"search.start.{name}", source)


def _check_tpe_axis(p: SearchParam, where: str, source: str) -> None:
    """A TPE axis: ``choices`` (categorical) or ``low < high`` (float, int; ``low > 0`` on a
    log scale)."""
    if p.values is not None:
        raise SweepError(f"{source}: {where}.values is for search.type=coordinate; TPE "
                         "takes low/high (float, int) or choices (categorical)")
    _choice(p.type, PARAM_TYPES, f"{where}.type", source)
    if p.type == "categorical":
        if not p.choices:
            raise SweepError(f"{source}: {where}.choices must be a non-empty list")
    elif p.low is None or p.high is None:
        advice = (f"; choices make a categorical axis: add {where}.type=categorical"
                  if p.choices else f"; give {where}.low and .high")
        raise SweepError(f"{source}: {where} (type {p.type}) needs low < high (got {p.low}, "
                         f"{p.high}){advice}")
    elif not p.low < p.high:
        raise SweepError(f"{source}: {where} needs low < high (got {p.low}, {p.high})")
    elif p.log and p.low <= 0:
        raise SweepError(f"{source}: {where}: log scale needs low > 0")
    elif p.choices:
        raise SweepError(f"{source}: {where}: choices are for type categorical, and low/high "
                         f"for float and int (type {p.type}); give one or the other")
    if p.type == "int":  # the schema reads low/high as floats (2 -> 2.0): back to integers
        if not (float(p.low).is_integer() and float(p.high).is_integer()):
            raise SweepError(f"{source}: {where} (type int) needs integer low and high (got "
                             f"{p.low}, {p.high})")
        p.low, p.high = int(p.low), int(p.high)


def _check_values(values: Any, where: str, source: str) -> None:
    """A non-empty list of scalars; strings must be single words."""
    if not isinstance(values, list) or not values:
        raise SweepError(f"{source}: {where} must be a non-empty list of values")
    for v in values:
        if not isinstance(v, str | int | float | bool):
            raise SweepError(f"{source}: {where}: value {v!r} is not a scalar")
        if isinstance(v, str) and (" " in v or not v):
            raise SweepError(f"{source}: {where}: value {v!r} must be a non-empty word")


def _check_bracket(spec: SweepSpec, source: str) -> None:
    b = spec.bracket
    if not spec.is_grid:
        raise SweepError(f"{source}: bracket grows a grid; this sweep has no 'grid'")
    if not b.axes or b.max_extensions < 1:
        raise SweepError(f"{source}: bracket needs axes (a list of grid axes) and "
                         f"max_extensions ≥ 1 (got {list(b.axes)}, {b.max_extensions})")
    for name, table in (("scale", b.scale), ("bounds", b.bounds)):
        for axis in table:
            if axis not in b.axes:
                raise SweepError(f"{source}: bracket.{name}.{axis} is not a bracketed axis; "
                                 f"bracket.axes: {', '.join(b.axes)}")
    for axis in b.axes:
        where = f"bracket.axes: {axis}"
        blocks = [block[axis] for block in spec.grid if axis in block]
        if not blocks:
            raise SweepError(f"{source}: {where} is not a grid axis; axes: "
                             f"{', '.join(spec.axes())}")
        values = [v for vs in blocks for v in vs]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise SweepError(f"{source}: {where} has non-numeric values; only numeric axes "
                             "can be bracketed")
        if not any(len(set(vs)) >= 2 for vs in blocks):
            raise SweepError(f"{source}: {where} needs two values or more in a block to have "
                             "a spacing to continue")
        scale = b.scale.get(axis, "auto")
        _choice(scale, SCALES, f"bracket.scale.{axis}", source)
        if scale == "log" and min(values) <= 0:
            raise SweepError(f"{source}: bracket.scale.{axis}=log needs values > 0")
        bounds = b.bounds.get(axis)
        if bounds is not None and not (len(bounds) == 2 and bounds[0] < bounds[1]):
            raise SweepError(f"{source}: bracket.bounds.{axis} must be [low, high] with "
                             f"low < high (got {list(bounds)})")


def check_template(command: str, extra: dict, source: str = "<sweep>") -> None:
    """Every ``{name}`` of the launch template must be known; ``{overrides}`` a word alone."""
    try:
        words = shlex.split(command)
    except ValueError as err:
        raise SweepError(f"{source}: launch.command: {err}") from None
    known = set(PLACEHOLDERS) | set(extra)
    for word in words:
        if "{overrides}" in word and word != "{overrides}":
            raise SweepError(f"{source}: launch.command: '{{overrides}}' must be a word of its "
                             f"own, not part of {word!r}")
        for _, name, _, _ in string.Formatter().parse(word):
            if name is not None and name.split(".")[0].split("[")[0] not in known:
                raise SweepError(f"{source}: launch.command: unknown placeholder {{{name}}}; "
                                 f"allowed: {', '.join(sorted(known))}")
    if "{run_dir}" not in command:
        raise SweepError(f"{source}: launch.command must pass {{run_dir}} to the trial")
