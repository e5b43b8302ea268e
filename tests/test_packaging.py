"""Every Python package of the repository is installed by pyproject.toml."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top, dotted in config["package-dir"].items():
        base = ROOT / dotted
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((top, *rel)))
    assert found - listed == set(), "add these packages to [tool.setuptools] packages"
