"""The error every config check raises: a clear line that names the key, instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that is well-typed but unusable; the message names the key."""


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)
