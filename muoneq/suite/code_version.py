"""The version of the code a process runs: the commit of the checkout its modules were imported
from, and whether their tracked files differed from that commit.

A run records it (``config.yaml``'s ``provenance``, ``metrics.json``): :func:`taken`, asked once
per process and kept, so that a commit, pull or edit of the checkout while a run goes on does
not change what the run says it ran. ``muoneq train`` asks before it imports the runtime. A warm
trial (:mod:`muoneq.suite.sweeps.warm`) runs code its server imported, possibly long before:
the server asks before its imports, each trial it forks inherits the answer and says so
(:func:`mark_forked`: ``provenance.forked_from``), and the sweep forks a trial only while the
checkout is still at that version (:func:`current`), else it starts a new server.

Only the standard library: a warm server imports this before anything a trial uses.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from muoneq.suite.folders import CHECKOUT

#: The environment variable naming the commit a run records; set, it wins over git (a copy of
#: the checkout without its ``.git``, e.g. on a lent machine, knows its commit only this way).
COMMIT_ENV = "MUONEQ_GIT_COMMIT"


@dataclass(frozen=True)
class CodeVersion:
    """What git says of a checkout at one moment."""

    commit: str | None  #: its HEAD (``$MUONEQ_GIT_COMMIT`` when set; None: no checkout of its own)
    dirty: bool | None  #: tracked files differ from HEAD (None: unknown)
    #: a digest of those differences: two versions with equal commit and changes hold the same
    #: tracked files (``dirty`` alone cannot tell one edit from the next)
    changes: str | None
    checkout: str  #: the folder asked
    #: the warm server this process was forked from (``pid``, ``started``), None when it imported
    #: its own modules
    forked_from: dict | None = None

    def same_code(self, other: CodeVersion) -> bool:
        return (self.commit, self.changes) == (other.commit, other.changes)

    def describe(self) -> str:
        """``commit 1a2b3c4d5e`` with `` (with uncommitted changes)`` when dirty."""
        if self.commit is None:
            return "no commit (not a git checkout of its own)"
        return f"commit {self.commit[:10]}" + (" with uncommitted changes" if self.dirty else "")


def short_commit(commit: str | None, dirty: bool | None) -> str:
    """A record's commit as its tables print it: ``1a2b3c4d5e``, `` (dirty)`` when its tracked
    files differed from it, ``no commit`` when there was none."""
    if commit is None:
        return "no commit"
    return commit[:10] + (" (dirty)" if dirty else "")


def _git(checkout: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "--no-optional-locks", *args], cwd=checkout,
                             capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode(errors="replace")


def current(checkout: Path = CHECKOUT) -> CodeVersion:
    """What the checkout ``checkout`` (by default the one this code lies in) holds now: its HEAD
    and its tracked files' differences from it. A folder in no checkout of its own (an installed
    wheel, a copy without ``.git``, a copy inside another repository, whose commit is not this
    code's: git's top level must be the folder) has no commit; ``$MUONEQ_GIT_COMMIT`` names
    one (its differences are then unknown)."""
    checkout = Path(checkout)
    given = os.environ.get(COMMIT_ENV)
    if given:
        return CodeVersion(given, None, None, str(checkout))
    top = _git(checkout, "rev-parse", "--show-toplevel")
    head = _git(checkout, "rev-parse", "HEAD")
    if top is None or head is None or Path(top.strip()).resolve() != checkout.resolve():
        return CodeVersion(None, None, None, str(checkout))
    diff = _git(checkout, "diff", "HEAD", "--binary", "--no-ext-diff", "--no-color")
    if diff is None:
        return CodeVersion(head.strip(), None, None, str(checkout))
    return CodeVersion(head.strip(), bool(diff), hashlib.sha256(diff.encode()).hexdigest()[:16],
                       str(checkout))


_taken: CodeVersion | None = None


def taken() -> CodeVersion:
    """This process's code version: :func:`current` when first asked, the same answer after."""
    global _taken
    if _taken is None:
        _taken = current()
    return _taken


def mark_forked(server_pid: int, server_started: str) -> None:
    """Say that this process was forked from the warm server ``server_pid`` (started at
    ``server_started``), whose :func:`taken` answer it inherited (its server asked before it
    imported anything a trial runs)."""
    global _taken
    _taken = replace(taken(), forked_from={"pid": server_pid, "started": server_started})
