"""Where the suite's data folders are: ``conf/`` (run configs) and ``sweeps/`` (sweep files).

Both are top-level folders of the repository. ``pyproject.toml`` ships them in the wheel as
package data, at ``muoneq/_suite/conf`` and ``muoneq/_suite/sweeps``; a checkout (the Makefile's
editable install, or the source tree on ``PYTHONPATH``) reads them where they are.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def suite_folder(name: str) -> Path:
    """The folder ``name`` (``conf`` or ``sweeps``) of this installation."""
    shipped = PACKAGE / "_suite" / name
    return shipped if shipped.is_dir() else PACKAGE.parent / name
