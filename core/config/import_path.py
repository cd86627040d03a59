"""Settings that name a Python object by import path ("package.module.Name"), e.g. training.callbacks."""

from __future__ import annotations

import importlib
from typing import Any

from core.config.errors import ConfigError


def import_object(path: Any, key: str) -> Any:
    """The object `path` names; ConfigError naming `key` when it names none."""
    module_name, _, name = str(path).rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}={path}: expected an import path package.module.Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}={path}: cannot import {module_name} ({e})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{key}={path}: {module_name} has no {name}")
    return getattr(module, name)


def split_target(entry: Any, key: str) -> tuple[Any, dict]:
    """An entry that names an object to make: an import path, or a mapping {_target_: <import path>, argument: value,
    ...} (Hydra's instantiate style); (the object, the arguments)."""
    if isinstance(entry, dict):
        if "_target_" not in entry:
            raise ConfigError(
                f"{key}: a mapping needs _target_: <package.module.Name> (it has: "
                f"{', '.join(map(str, entry)) or 'nothing'})"
            )
        return import_object(entry["_target_"], f"{key}._target_"), {k: v for k, v in entry.items() if k != "_target_"}
    return import_object(entry, key), {}
