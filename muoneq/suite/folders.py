"""Where the suite's data folders are: ``conf/`` (run configs) and ``sweeps/`` (sweep files).

Both are top-level folders of the repository. ``pyproject.toml`` ships them in the wheel as
package data, at ``muoneq/suite/shipped/conf`` and ``muoneq/suite/shipped/sweeps``; a checkout
(the Makefile's editable install, or the source tree on ``PYTHONPATH``) reads them where they are.
"""

from __future__ import annotations

from pathlib import Path

SUITE = Path(__file__).resolve().parent
#: The repository's root, when this is a checkout (``muoneq/suite/`` → the root).
CHECKOUT = SUITE.parents[1]


def suite_folder(name: str) -> Path:
    """The folder ``name`` (``conf`` or ``sweeps``) of this installation."""
    shipped = SUITE / "shipped" / name
    return shipped if shipped.is_dir() else CHECKOUT / name
