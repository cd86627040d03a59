"""What a resumed run may change from the run that wrote its checkpoint (core/config/identity.py says
which keys change a run's result).

A run that differs from its checkpoint in such keys stops before any work with the list, unless
`checkpoint.allow_config_changes=true` continues on purpose (the new values then take effect:
core/training/optim.py:apply_config). Other changes are listed in the log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.config.identity import changes_result
from core.config.validation import to_plain


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved_config: Path, config: DictConfig) -> tuple[list[str], list[str]]:
    """(result-changing, other) differences between a checkpoint's config.yaml and `config`, as
    "key: old -> new" lines."""
    saved = flatten(OmegaConf.to_container(OmegaConf.load(saved_config)))
    now = flatten(to_plain(config))
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    lines = {k: f"{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}" for k in changed}
    # A key only one side has is a schema change between versions of this tool (its default keeps the
    # earlier behaviour), not a change of the run.
    refused = [k for k in changed if k in saved and k in now and changes_result(k)]
    return [lines[k] for k in refused], [lines[k] for k in changed if k not in refused]
