"""The study's TensorBoard view, ``<study>/tensorboard/``: every run by a short name that keeps
what tells it apart, for ``tensorboard --logdir runs/<study>/tensorboard``.

TensorBoard names a run by its event folder's path under ``--logdir``. A run folder's path
holds its point's every axis (the demo's ``trials/optimizer=muoneq_nes,optimizer.lr=0.04,
optimizer.momentum=0.75,optimizer.mode=RC/seed0/tensorboard``: 105 characters, which
TensorBoard's run list cuts before the mode and the seed). The view is a tree of symbolic
links, one per run:

* ``<name>/seed<N>`` → ``../../trials/<point>/seed<N>/tensorboard``, where ``<name>`` holds only
  the axes whose values differ between the study's points, in the axes' order: a config
  group's choice by itself, another axis as ``name=value`` with ``optimizer.`` left out of its
  name and a number to 4 significant digits (``muoneq_nes,lr=0.04,mode=RC/seed0``, 32
  characters); points whose names would coincide (or be ``hparams`` or ``report``) keep their
  run folder's name;
* ``hparams`` → ``../hparams`` (the HParams experiment config; each run's session lies beside
  its curves, so it pairs with the run's short name) and ``report`` →
  ``../report/tensorboard`` (the report's figures and tables).

Why links, rather than shorter run folders: the run folder is the run's identity, which the
sweep looks up to resume a run, never to run it twice, and to compare its ``trial.json`` and
``config.yaml`` with the point (and which the preflight checks for two points sharing one); the
axes that differ change as a grid grows (bracketing adds values, a user adds an axis), so a
folder named by them would change its name, or stop telling points apart, while the runs it
holds go on. A view can be rebuilt whenever the points change, and studies made before it
keep their folders. TensorBoard recommends "a symlink tree" over ``--logdir_spec`` for naming
runs (``tensorboard --helpfull``), and both of its loaders follow links: the Python one walks a
local logdir with ``gfile.walk``, whose ``isdir`` follows links (``tensorboard.backend.
event_processing.io_wrapper.ListRecursivelyViaWalking``; TensorFlow's ``gfile`` and
TensorBoard's stub of it alike), and so does the Rust data server (``--load_fast``); a link
whose run has not started yet points at nothing and is no run. ``tensorboard --logdir
runs/<study>`` shows every run twice (by its folder and by its link), so the commands the
suite prints point at the view.

Only links are ever removed from the view (never their targets, never a file of anyone's), and
the folders left empty by that; a ``<study>/tensorboard`` that is a link or a file is left
alone, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from muoneq.suite.runtime.metrics import TENSORBOARD_DIR
from muoneq.suite.sweeps.events import HPARAMS_DIR
from muoneq.suite.sweeps.spec import Point, SweepSpec, folder_name, format_value
from muoneq.suite.sweeps.trial_record import TrialRecord

log = logging.getLogger("muoneq.suite.sweeps")

#: the view's folder in the study's, and its entries besides the runs
VIEW_DIR = TENSORBOARD_DIR
EXTRAS = {"hparams": Path(HPARAMS_DIR), "report": Path("report") / TENSORBOARD_DIR}


def label(axis: str, value: Any, exact: bool = False) -> str:
    """``lr=0.04``: an axis without ``optimizer.``, a number to 4 significant digits unless
    ``exact``."""
    text = f"{value:.4g}" if isinstance(value, float) and not exact else format_value(value)
    return f"{axis.removeprefix('optimizer.')}={text}"


def short_names(points: Iterable[Point]) -> dict[str, str]:
    """Each point's name in the view, by its key (module docstring): its values on the axes
    that differ between ``points`` (every axis when none does), a config group's choice by
    itself (``muoneq_nes``, not ``optimizer=muoneq_nes``); its run folder's name where that
    would not tell it apart."""
    from muoneq.suite.runtime.config import GROUPS

    points = list({p.key: p for p in points}.values())
    values: dict[str, set[str]] = {}
    for p in points:
        for axis, value in p.items:
            values.setdefault(axis, set()).add(format_value(value))
    differ = {a for a, v in values.items() if len(v) > 1} or set(values)
    names = {p.key: folder_name(",".join(
        format_value(v) if a in GROUPS else label(a, v) for a, v in p.items if a in differ))
        for p in points}
    counts = Counter(names.values())
    clash = {n for n, c in counts.items() if c > 1} | set(EXTRAS)  # an optimizer "report"
    names = {p.key: p.slug() if names[p.key] in clash else names[p.key] for p in points}
    if len(set(names.values())) < len(names):  # a short name that is another's folder name
        names = {p.key: p.slug() for p in points}
    return names


def study_runs(spec: SweepSpec, trials: Iterable) -> dict[Path, tuple[Point, int]]:
    """Every run of the study, by its folder relative to the study's: the grid as written on
    each seed (so that the names are those of the whole grid from its first run) and each run a
    trial records (bracketing's, a search's)."""
    runs: dict[Path, tuple[Point, int]] = {}
    for point in spec.points() if spec.is_grid else []:
        for seed in spec.seeds:
            runs[point.run_dir(Path(), seed)] = (point, seed)
    for t in trials:
        rec = TrialRecord.of(t)
        if not (isinstance(rec.point, dict) and isinstance(rec.run_dirs, list)
                and isinstance(rec.seeds, list)):
            continue  # no run yet (asked, skipped), or not a record this driver wrote
        point = Point(tuple(rec.point.items()))
        for seed, rel in zip(rec.seeds, rec.run_dirs, strict=False):
            rel = Path(str(rel))
            if not rel.is_absolute() and ".." not in rel.parts:  # inside the study folder
                runs.setdefault(rel, (point, seed))
    return runs


def links(runs: Mapping[Path, tuple[Point, int]]) -> dict[Path, Path]:
    """The view's entries, relative to the study folder: link → what it points at."""
    names = short_names(point for point, _ in runs.values())
    out = {Path(VIEW_DIR) / name: target for name, target in EXTRAS.items()}
    for rel, (point, seed) in runs.items():
        out[Path(VIEW_DIR) / names[point.key] / f"seed{seed}"] = rel / TENSORBOARD_DIR
    return out


def write_view(study_dir: Path, runs: Mapping[Path, tuple[Point, int]]) -> None:
    """Make ``<study>/tensorboard/`` hold exactly the links of :func:`links` (module
    docstring); a warning, never an error, when it cannot (the view is a convenience)."""
    study_dir = Path(study_dir)
    view = study_dir / VIEW_DIR
    if view.is_symlink() or (view.exists() and not view.is_dir()):
        log.warning("%s is not a folder the sweep made: no TensorBoard view of short run names "
                    "(tensorboard --logdir %s shows the runs by their folders)", view, study_dir)
        return
    wanted = {study_dir / link: target for link, target in links(runs).items()}
    try:
        _prune(view, wanted)
        for link, target in wanted.items():
            relative = Path(os.path.relpath(study_dir / target, link.parent))
            if link.is_symlink():
                if Path(os.readlink(link)) == relative:
                    continue
                link.unlink()  # an older link of the view
            elif link.exists():  # someone's file, or a folder of theirs
                log.warning("%s is in the way of TensorBoard's view of a run: left alone", link)
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another driver of the study made it
                link.symlink_to(relative)
    except OSError as err:
        log.warning("TensorBoard's view of the runs (%s) not written: %s", view, err)


def _prune(view: Path, wanted: Mapping[Path, Path]) -> None:
    """Remove the links of ``view`` that are not ``wanted`` (and the folders that leaves
    empty); nothing else."""
    if not view.is_dir():
        return
    for folder, dirs, files in os.walk(view, topdown=False):  # links are not followed
        for name in dirs + files:
            path = Path(folder) / name
            # another driver of the study may prune or add at the same time
            with contextlib.suppress(FileNotFoundError):
                if path.is_symlink() and path not in wanted:
                    path.unlink()
                elif name in dirs and not path.is_symlink() and not any(path.iterdir()):
                    with contextlib.suppress(OSError):  # no longer empty
                        path.rmdir()


class StudyView:
    """Keeps a study's view current while its driver runs: rewritten when its runs change."""

    def __init__(self, spec: SweepSpec, study_dir: Path):
        self.spec, self.study_dir = spec, Path(study_dir)
        self._written: dict[Path, tuple[Point, int]] | None = None

    def update(self, trials: Iterable) -> None:
        runs = study_runs(self.spec, trials)
        if runs != self._written:
            write_view(self.study_dir, runs)
            self._written = runs


def logdir(study_dir: Path) -> Path:
    """What ``tensorboard --logdir`` should read of a study: its view, or the study folder of
    one made before views were (a view appears when its sweep or report runs again)."""
    view = Path(study_dir) / VIEW_DIR
    return view if view.is_dir() and not view.is_symlink() else Path(study_dir)


def command(study_dir: Path) -> str:
    """The TensorBoard command that shows a study, as it runs from here
    (:func:`muoneq.suite.cli.program`)."""
    from muoneq.suite.cli import program

    return shlex.join([program("tensorboard", "tensorboard.main"), "--logdir",
                       str(logdir(study_dir))])
