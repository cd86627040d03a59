"""Command-line overrides checked against the schemas before Hydra composes, so that a misspelt or
misplaced key gets the key that exists instead of Hydra's advice to add it with `+`:

    train.py ... training.checkpoint.path=ckpts/vit
    config error: unknown key 'training.checkpoint.path'; did you mean 'checkpoint.path'?
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable, Optional

from core.config.errors import ConfigError


def schema_keys(schema: Any, prefix: str = "") -> set[str]:
    """Every dotted key of a schema dataclass: leaves and the nodes above them."""
    keys = set()
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.add(key)
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            keys |= schema_keys(type(nested), key + ".")
    return keys


def suggestion(key: str, valid: set[str]) -> Optional[str]:
    """The valid key closest to `key`: one with the same ending (a misplaced key), else the nearest spelling; a close
    spelling in the key's own section first (model.dropout -> model.hidden_dropout, not finetune.lora.dropout)."""
    parts = key.split(".")
    own = sorted(k for k in valid if len(parts) > 1 and k.startswith(parts[0] + "."))
    near = difflib.get_close_matches(key, own, n=1, cutoff=0.75)
    if near:
        return near[0]
    for n in range(
        len(parts) - 1, 0, -1
    ):  # the longest matching tail first: training.checkpoint.path -> checkpoint.path
        tail = ".".join(parts[-n:])
        same_tail = sorted(k for k in valid if k == tail or k.endswith("." + tail))
        if same_tail:
            return min(same_tail, key=lambda k: (-difflib.SequenceMatcher(None, k, key).ratio(), k))
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return close[0] if close else None


def check_overrides(overrides: Iterable[str], valid: set[str], groups: set[str]) -> None:
    """Raise ConfigError for an override whose key no schema has (Hydra's own keys and config group choices
    are left to Hydra)."""
    for override in overrides:
        if "=" not in override or override.startswith("-"):
            continue
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra") or "/" in key or "@" in key or key in groups or key in valid:
            continue
        hint = suggestion(key, valid)
        raise ConfigError(
            f"unknown key {key!r}"
            + (f"; did you mean {hint!r}?" if hint else "")
            + " (every key and its default: core/config/schema.py and the recipes' config.py)"
        )
