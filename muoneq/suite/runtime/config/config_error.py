"""How a config that cannot run is reported: :class:`ConfigError`, one line naming the key, the
file it came from and the allowed keys or values."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from muoneq.suite.errors import UserError


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message names the key and the allowed keys/values."""


def _allowed_keys(schema: DictConfig, full_key: str) -> list[str]:
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    node = OmegaConf.select(schema, parent) if parent else schema
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def config_error(err: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    message = f"{source}: {key}: {first}"
    if "not in" in first or "Missing key" in first:
        allowed = _allowed_keys(schema, key)
        if allowed:
            message += f"; allowed keys: {', '.join(allowed)}"
    return ConfigError(message)
