"""What a resumed run may change from the run that wrote its checkpoint (core/config/identity.py says
which keys change a run's result).

A run that differs from its checkpoint in such keys stops before any work with the list, unless
`checkpoint.allow_config_changes=true` continues on purpose (the new values then take effect:
core/training/optim.py:apply_config). Other changes are listed in the log.

The checkpoint's config.yaml is read as plain data (core/checkpointing/saved_config.py). One that cannot be
read that way (damaged, or not written by a run) cannot show that the settings are the same, so it is
reported like a changed result-changing setting: the resume stops naming the file and why, and
`checkpoint.allow_config_changes=true` resumes anyway. Its weights are not lost to a broken side file.
The same holds for a file that does not fit the run's schemas (an unknown key, a section that is not a
mapping, a value of the wrong type: predict.py refuses such a file too).

A key the file lacks comes from a schema change between versions of this tool: the older version ran with
the schema's default. So a result-changing key the file lacks is compared with that default (a run that
sets another value is refused like any other change); one with no default to compare with is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import is_structured_config
from omegaconf.errors import OmegaConfBaseException

from core.checkpointing.layout import CheckpointError
from core.checkpointing.saved_config import plain_values, read_config_file
from core.config.identity import changes_result
from core.config.validation import to_plain


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _fitted(file: Path, tree: dict, config: DictConfig) -> DictConfig:
    """`tree` (the file's settings) merged into the run's schemas: each section into the type of the run's node
    for it (OmegaConf.get_type: the recipe's model and data schemas too, without importing recipes), so a key
    the file lacks holds that schema's default. CheckpointError naming the file and the key on a misfit."""
    schema = OmegaConf.structured(OmegaConf.get_type(config))
    for name in config:
        node = config._get_node(name)
        if isinstance(node, DictConfig) and is_structured_config(OmegaConf.get_type(node)):
            if name in tree and not isinstance(tree[name], dict):
                raise CheckpointError(
                    f"{file}: '{name}' is a {type(tree[name]).__name__}, expected a mapping of settings"
                )
            schema[name] = OmegaConf.structured(OmegaConf.get_type(node))
    try:
        return OmegaConf.merge(schema, tree)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        message = str(getattr(e, "msg", e)).splitlines()[0]
        raise CheckpointError(f"{file}: {key or 'the top level'}: {message}") from None


def _default(fitted: DictConfig, key: str) -> tuple[bool, Any]:
    """(whether the schema gives `key` a default, that default as a plain value). Only the schema's own
    interpolations are resolved here (the file's values hold none)."""
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(fitted, parent_key) if parent_key else fitted
    if not isinstance(parent, DictConfig) or name not in parent or OmegaConf.is_missing(parent, name):
        return False, None
    try:
        value = parent[name]
        return True, plain_values(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
    except OmegaConfBaseException:
        return False, None


def config_changes(saved_config: Path, config: DictConfig) -> tuple[list[str], list[str]]:
    """(result-changing, other) differences between a checkpoint's config.yaml and `config`, as
    "key: old -> new" lines (a config.yaml that cannot be read safely or does not fit the run's schemas: one
    result-changing line saying why)."""
    now = flatten(to_plain(config))
    try:
        tree = read_config_file(saved_config)
        if tree.get("recipe") != config.get("recipe"):  # another recipe's sections fit other schemas
            return [f"recipe: {tree.get('recipe', '(absent)')!r} -> {config.get('recipe')!r}"], []
        fitted = _fitted(saved_config, tree, config) if is_structured_config(OmegaConf.get_type(config)) else None
    except CheckpointError as e:
        return [f"{e}: the settings it was trained with cannot be compared"], []
    written = flatten(tree)
    saved = flatten(plain_values(OmegaConf.to_container(fitted, resolve=False))) if fitted is not None else written
    refused, other = [], []
    for k in sorted(set(written) | set(now)):
        if k in written and k in now:
            old = saved.get(k, written[k])
            if old != now[k]:
                (refused if changes_result(k) else other).append(f"{k}: {old!r} -> {now[k]!r}")
        elif k in now and changes_result(k) and fitted is not None:
            # Absent from the file: the older version ran with the schema's default.
            has_default, default = _default(fitted, k)
            if not has_default:
                refused.append(
                    f"{k}: absent from {saved_config}, and its schema has no default to compare with -> {now[k]!r}"
                )
            elif default != now[k]:
                refused.append(f"{k}: {default!r} (absent from the file: the default) -> {now[k]!r}")
            else:
                other.append(f"{k}: (absent: the default) -> {now[k]!r}")
        else:  # a key only one side has, that leaves the result alone: a schema change between versions
            other.append(f"{k}: {written.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}")
    return refused, other


def data_changes(saved_len: int, saved_fingerprint: int, now_len: int, now_fingerprint: int) -> tuple[list[str], bool]:
    """(how the training set differs from the one a checkpoint was trained on, as lines; whether that is known to
    be another set of samples). The sample stream is a function of the set's length and of what each index holds,
    so another set under the same settings (files added, removed or renamed, a class folder renamed: every later
    class's label moves) would continue the run on another order or other labels (core/data/fingerprint.py).
    Without a fingerprint on both sides (a checkpoint of an earlier version; a dataset that has none, such as GPT's,
    whose length follows training.steps across epochs) only a changed length is told, as a changed order."""
    changes = [f"training samples: {saved_len} -> {now_len}"] if saved_len and saved_len != now_len else []
    if not (saved_fingerprint and now_fingerprint):
        return changes, False
    if saved_fingerprint != now_fingerprint and not changes:
        changes.append(f"training samples: the same number ({now_len}), but other files, labels or contents")
    return changes, bool(changes)
