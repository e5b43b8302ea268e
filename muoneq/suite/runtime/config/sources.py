"""Where config files are: the config folder (``conf/`` or ``$MUONEQ_CONF_DIR``), a group's file
(``conf/<group>/<choice>.yaml`` or a path), and reading one as a mapping."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from muoneq.suite.folders import suite_folder
from muoneq.suite.runtime.config.config_error import ConfigError

#: The config groups: ``<group>=<choice>`` on the command line selects
#: ``conf/<group>/<choice>.yaml``.
GROUPS = ("experiment", "task", "optimizer", "trainer")


def conf_dir() -> Path:
    """``$MUONEQ_CONF_DIR`` if set (a config folder of one's own, used instead), else the
    suite's ``conf/`` (shipped with the package, or the checkout's: :mod:`muoneq.suite.folders`)."""
    if env := os.environ.get("MUONEQ_CONF_DIR"):
        return Path(env)
    return suite_folder("conf")


def group_file(group: str, choice: str, root: Path) -> Path:
    """``conf/<group>/<choice>.yaml``, or ``choice`` itself when it is a path to a YAML file."""
    if choice.endswith((".yaml", ".yml")):
        path = Path(choice)
    else:
        path = root / group / f"{choice}.yaml"
    if not root.is_dir():
        raise ConfigError(
            f"config folder {root} does not exist; point MUONEQ_CONF_DIR at a folder of configs "
            "(<group>/<name>.yaml), or unset it to use the configs muoneq ships"
        )
    if not path.is_file():
        known = sorted(p.stem for p in (root / group).glob("*.yaml"))
        hint = difflib.get_close_matches(choice, known, n=1)
        raise ConfigError(
            f"{group}={choice}: no such file {path}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f"; available: {', '.join(known) or '(none)'}"
        )
    return path


def load_yaml(path: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except OSError:
        raise  # unreadable: said in one line by the command (muoneq.suite.files.no_access)
    except Exception as err:  # yaml syntax errors come in several types
        raise ConfigError(f"{path}: cannot parse YAML: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded
