"""What a resumed run may change from the run that wrote its checkpoint (core/config/identity.py says
which keys change a run's result).

A run that differs from its checkpoint in such keys stops before any work with the list, unless
`checkpoint.allow_config_changes=true` continues on purpose (the new values then take effect:
core/training/optim.py:apply_config). Other changes are listed in the log.

The checkpoint's config.yaml is read as plain data (core/checkpointing/saved_config.py). One that cannot be
read that way (damaged, or not written by a run) cannot show that the settings are the same, so it is
reported like a changed result-changing setting: the resume stops naming the file and why, and
`checkpoint.allow_config_changes=true` resumes anyway. Its weights are not lost to a broken side file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from core.checkpointing.layout import CheckpointError
from core.checkpointing.saved_config import read_config_file
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
    "key: old -> new" lines (a config.yaml that cannot be read safely: one result-changing line saying why)."""
    try:
        saved = flatten(read_config_file(saved_config))
    except CheckpointError as e:
        return [f"{e}: the settings it was trained with cannot be compared"], []
    now = flatten(to_plain(config))
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    lines = {k: f"{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}" for k in changed}
    # A key only one side has is a schema change between versions of this tool (its default keeps the
    # earlier behaviour), not a change of the run.
    refused = [k for k in changed if k in saved and k in now and changes_result(k)]
    return [lines[k] for k in refused], [lines[k] for k in changed if k not in refused]
