"""Mistakes a user can fix, and how the ``muoneq`` command shows them.

Every expected mistake (an invalid config or sweep, missing data, a tokenizer that does not
match the shards, an accelerator this machine lacks, a refused resume) raises a
:class:`UserError`. The ``muoneq`` command prints it as one line,
``muoneq: <what>; <how to fix>`` (plus indented details, e.g. one line per differing key of a
refused resume), and exits with status 2 and no traceback; ``--debug`` or ``MUONEQ_DEBUG=1``
shows the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Sequence


class UserError(Exception):
    """A mistake the user can fix. ``str(err)`` is one line: what is wrong, then ``;`` and how
    to fix it. ``details`` are extra lines (shown indented under it)."""

    #: the exit status of the ``muoneq`` command (2: the command line or its inputs are wrong)
    exit_code = 2

    def __init__(self, message: str, details: Sequence[str] = ()):
        super().__init__(" ".join(str(message).split()))
        self.details = list(details)


class DataError(UserError, FileNotFoundError):
    """Data that is missing or unusable (the message says where to put it or how to get it)."""


class Interrupted(UserError):
    """Training stopped by SIGINT (Ctrl-C) or SIGTERM; the run can be continued. The exit status
    is the shell's for the signal: 130 (SIGINT) or 143 (SIGTERM)."""

    exit_code = 130

    def __init__(self, message: str, details: Sequence[str] = (), *, exit_code: int = 130):
        super().__init__(message, details)
        self.exit_code = exit_code


class Diverged(UserError):
    """The run's loss or validation metric became NaN or infinite: it stopped, and its
    ``metrics.json`` says ``"status": "diverged"``."""

    exit_code = 3


class DiskFull(UserError, OSError):
    """A write failed for lack of space (ENOSPC, EDQUOT); the message names the path."""

    exit_code = 4


def format_error(err: UserError, prog: str = "muoneq") -> str:
    """The text the command prints: ``muoneq: <message>`` and the indented details."""
    return "\n".join([f"{prog}: {err}", *(f"  {line}" for line in err.details)])
