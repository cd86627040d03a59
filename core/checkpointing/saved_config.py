"""A step folder's config.yaml (the resolved config of the run that trained it), read back safely, and the
model settings that predict.py, generate.py and `checkpoint.py to-hf` take from it.

The file may come from anyone (a downloaded checkpoint), so it is only ever parsed as plain YAML data
(a safe loader: no tags that build objects, no aliases) and never handed to OmegaConf as text: OmegaConf
resolves `${...}` interpolations on access, and resolvers run code (oc.env reads the environment, oc.create
builds nodes, this repository's run_id / run_dir read the launcher's store and run records). A run writes
every value resolved, so a `${` anywhere means the file is not one a run wrote, and it is refused. The
parts that are used are checked against the recipe's schemas (keys, types, the RANGES tables); any problem
is a CheckpointError naming the file.

Which settings come from the file: every `model` key but the neutral ones (core/config/identity.py: e.g.
model.backend, a speed choice), the `data` keys the trained model depends on (its recipe's
`model_data_keys`), and the `finetune` keys that shape the model's parameters: finetune.mode, and under
frozen or lora the head (finetune.head: its modules take no adapters), under lora the adapters'
finetune.lora.* (a LoRA step folder holds adapter weights that only a model built with them takes). The data
itself (data.root, the splits, predict.split / predict.folder) stays the command's.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf._utils import get_yaml_loader
from omegaconf.errors import OmegaConfBaseException

from core.checkpointing.layout import COMPLETE_MARKER, CheckpointError, read_marker, resolve_checkpoint
from core.config.errors import ConfigError
from core.config.file_shape import read_small_file
from core.config.identity import changes_result
from core.config.ranges import rules_of
from core.config.schema import FinetuneConfig, FinetuneMode, LoraConfig

log = logging.getLogger("checkpoint")

CONFIG_FILE = "config.yaml"
# A run's config.yaml is a few kilobytes; a far larger file is not one, and is not parsed.
MAX_BYTES = 1 << 20


class _PlainLoader(get_yaml_loader()):
    """The safe YAML loader OmegaConf itself reads with (so values read back as they were written: 1e-3 a
    float, a date-like text a string; a duplicate key an error), refusing aliases: a run's file has none,
    and nested ones let a small file expand into a huge one."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "found an alias (*name), which a run's config never has", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def _check_plain(value: Any, where: str) -> None:
    """Only mappings with text keys, lists, text, numbers, booleans and null; no interpolation."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or "${" in k:
                raise ValueError(f"key {k!r} under {where or 'the top'}: expected a plain name")
            _check_plain(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif isinstance(value, str):
        if "${" in value:
            raise ValueError(
                f"{where}={value!r} is an interpolation, which a run's config never holds (its values are "
                "written resolved); refused without resolving it"
            )
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise ValueError(f"{where}: a {type(value).__name__} value, expected text, a number, a boolean or null")


def read_config_file(file: Path) -> dict:
    """A run's config.yaml as plain Python values; CheckpointError naming the file when it is not one."""
    file = Path(file)
    try:
        # A regular file of at most MAX_BYTES, opened without waiting (a FIFO, a link to /dev/zero: refused).
        data = read_small_file(file, MAX_BYTES, follow_symlinks=True)
        tree = yaml.load(data.decode("utf-8"), Loader=_PlainLoader)
        if not isinstance(tree, dict):
            raise ValueError(f"expected a mapping of settings at the top, found {type(tree).__name__}")
        _check_plain(tree, "")
    except OSError as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text ({e})") from None
    except (yaml.YAMLError, RecursionError) as e:
        message = str(e).replace("\n", " ") if not isinstance(e, RecursionError) else "nested too deeply"
        raise CheckpointError(f"{file}: not a YAML config ({message})") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return tree


def plain_values(value: Any) -> Any:
    """`value` with enum members as their values (the plain data a YAML file holds)."""
    if isinstance(value, dict):
        return {k: plain_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_values(v) for v in value]
    return value.value if isinstance(value, Enum) else value


def _checked(file: Path, section: str, schema: type, values: Any, keys: Optional[Iterable[str]] = None) -> dict:
    """`values` (the file's `section`) merged into the schema: unknown keys and wrong types are refused, a
    key the file lacks takes the schema's default (a field added since: its default keeps the earlier
    behaviour); then the RANGES rules. Returns the schema's fields (or `keys` of them) as plain values."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{file}: '{section}' is a {type(values).__name__}, expected a mapping of settings")
    wanted = list(keys) if keys is not None else None
    try:
        node = OmegaConf.merge(
            OmegaConf.structured(schema), values if wanted is None else {k: v for k, v in values.items() if k in wanted}
        )
        fields = OmegaConf.to_container(node, resolve=False)
        picked = {k: fields[k] for k in (wanted if wanted is not None else fields)}
        missing = [k for k, v in picked.items() if v == "???"]
        if missing:
            raise CheckpointError(f"{file}: {section}.{missing[0]} is missing (the schema has no default for it)")
        rules = rules_of(schema)
        for k, v in picked.items():
            if k in rules:
                rules[k].check(v, f"{section}.{k}")
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        message = str(getattr(e, "msg", e)).splitlines()[0]
        where = f"{section}.{key}" if key else f"'{section}'"
        raise CheckpointError(f"{file}: {where}: {message}") from None
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{file}: {e}") from None
    return {k: plain_values(v) for k, v in picked.items()}


@dataclass(frozen=True)
class SavedConfig:
    file: Path
    recipe: str
    # "model.<field>" for every field of the recipe's model schema, "data.<key>" for its model_data_keys (and
    # any asked for), "finetune.<key>" for those that shape the parameters (_finetune_settings), as plain values
    # checked against the schemas.
    settings: dict[str, Any]
    model_data_keys: tuple[str, ...] = ()  # the recipe's

    @property
    def model_settings(self) -> dict[str, Any]:
        """The settings a model built from this checkpoint takes: the model's, the recipe's model_data_keys and the
        finetune keys that shape its parameters, but not the neutral ones (model.backend)."""
        model_data = {f"data.{k}" for k in self.model_data_keys}
        return {
            k: v
            for k, v in self.settings.items()
            if (k.startswith(("model.", "finetune.")) or k in model_data) and changes_result(k)
        }

    def section(self, name: str) -> dict[str, Any]:
        """e.g. section("model") -> {"hidden_size": 64, ...}"""
        return {k.split(".", 1)[1]: v for k, v in self.settings.items() if k.startswith(name + ".")}


def read_saved_config(
    file: Path, get_recipe: Callable[[str], type], expected_recipe: Optional[str] = None, data_keys: Iterable[str] = ()
) -> SavedConfig:
    """A step folder's config.yaml: its recipe (which must be `expected_recipe` when given), its model section
    and the recipe's model_data_keys (plus `data_keys`), checked against that recipe's schemas.
    CheckpointError naming the file otherwise."""
    file = Path(file)
    tree = read_config_file(file)
    recipe_name = tree.get("recipe")
    if not isinstance(recipe_name, str):
        raise CheckpointError(f"{file}: 'recipe' is {recipe_name!r}, expected the name of a recipe")
    try:
        recipe = get_recipe(recipe_name)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None
    if expected_recipe is not None and recipe_name != expected_recipe:
        raise CheckpointError(
            f"{file}: recipe: {recipe_name}, but this needs a checkpoint of the {expected_recipe} "
            f"recipe (recipe: {expected_recipe})"
        )
    keys = tuple(dict.fromkeys((*recipe.model_data_keys, *data_keys)))
    settings = {f"model.{k}": v for k, v in _checked(file, "model", recipe.model_schema, tree.get("model")).items()}
    if keys:
        data = _checked(file, "data", recipe.data_schema, tree.get("data"), keys)
        settings |= {f"data.{k}": v for k, v in data.items()}
    settings |= _finetune_settings(file, tree.get("finetune"))
    return SavedConfig(file, recipe_name, settings, tuple(recipe.model_data_keys))


def _finetune_settings(file: Path, values: Any) -> dict[str, Any]:
    """ "finetune.mode", and under frozen or lora "finetune.head", under lora "finetune.lora.<key>": what decides the
    parameters a model built for this checkpoint has (LoRA adds adapters to every target module outside the head).
    A file without a finetune section is a run from before it existed, which trained every weight (mode full)."""
    values = {} if values is None else values
    picked = _checked(file, "finetune", FinetuneConfig, values, ("mode", "head"))
    settings: dict[str, Any] = {"finetune.mode": picked["mode"]}
    if picked["mode"] != FinetuneMode.full.value:
        settings["finetune.head"] = picked["head"]
    if picked["mode"] == FinetuneMode.lora.value:
        lora = _checked(file, "finetune.lora", LoraConfig, values.get("lora", {}))
        settings |= {f"finetune.lora.{k}": v for k, v in lora.items()}
    return settings


def saved_config_file(init_from: Optional[str]) -> Optional[Path]:
    """The config.yaml of checkpoint.init_from (a step folder, or a checkpoint root: its newest complete step);
    None for a weights file (.pt / .safetensors), which holds no settings, or a folder without one (e.g.
    `checkpoint.py from-torch` output)."""
    if not init_from:
        return None
    step = resolve_checkpoint(init_from)
    file = step / CONFIG_FILE
    return file if step.is_dir() and file.is_file() else None


def trained_config(init_from: str, configs: Iterable[str], recipe_configs: dict[str, str]) -> tuple[str, str]:
    """For predict.py and generate.py given no --config-name: the config to compose for checkpoint.init_from (a step
    folder, or a run's checkpoint folder: its newest complete step) and why that one. The config the step was trained
    with, which its COMPLETE marker names (when it is one of `configs`: the name comes from a file), else its recipe's
    entry in `recipe_configs` (the recipe from its config.yaml). ConfigError for a checkpoint that names no recipe (a
    weights file, a folder without config.yaml); CheckpointError naming the file for one that cannot be read."""
    step = resolve_checkpoint(init_from)
    file = step / CONFIG_FILE
    if not step.exists():
        raise ConfigError(f"checkpoint.init_from={init_from}: no such file or folder")
    if not (step.is_dir() and file.is_file()):
        raise ConfigError(
            f"checkpoint.init_from={init_from}: {step} holds no {CONFIG_FILE} (a weights file, or a "
            "converted folder), so it does not say which config to use: give one with --config-name"
        )
    recipe = read_config_file(file).get("recipe")
    if recipe not in recipe_configs:
        raise CheckpointError(f"{file}: recipe: {recipe!r}, expected one of {', '.join(recipe_configs)}")
    recorded = read_marker(step).get("config_name") if (step / COMPLETE_MARKER).is_file() else None
    if isinstance(recorded, str) and recorded in configs:
        return recorded, f"the config {step} was trained with"
    why = (
        f"the config it names, {recorded!r}, is not one of configs/"
        if recorded is not None
        else "its step folder does not name the config it was trained with"
    )
    return recipe_configs[recipe], f"the {recipe} recipe's config for predictions on {step} ({why})"


def explicit_keys(overrides: Iterable[str]) -> dict[str, str]:
    """The keys a command line sets, each with the override that sets it: `model.depth=4` sets model.depth,
    and a `model=<name>` group choice sets every model key. A `data=<name>` choice picks the data, not its
    preprocessing: it sets none of the data keys a model depends on."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"unreadable command-line override: {e}") from None
    keys = {}
    for override in parsed:
        key = override.key_or_group
        if override.package is None and ("." in key or key == "model"):
            keys[key] = override.input_line
    return keys


def _setter(key: str, explicit: dict[str, str]) -> Optional[str]:
    """The override that sets `key` (itself or a node above it), if any."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in explicit:
            return explicit[".".join(parts[:n])]
    return None


def _given(cfg: DictConfig, key: str, directly: bool) -> tuple[bool, Any]:
    """(whether the config gives `key` a value of its own, that value as a plain value). A value that
    follows another key (an interpolation such as model.num_classes: ${data.num_classes}) is its own only
    when the key itself is on the command line."""
    parent_key, name = key.rsplit(".", 1)
    parent = OmegaConf.select(cfg, parent_key)
    if not isinstance(parent, DictConfig) or name not in parent or OmegaConf.is_missing(parent, name):
        return False, None
    if OmegaConf.is_interpolation(parent, name) and not directly:
        return False, None
    value = parent[name]
    return True, plain_values(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)


def adopt_saved_model(cfg: DictConfig, overrides: Iterable[str], get_recipe: Callable[[str], type]) -> DictConfig:
    """`cfg` with the model settings of checkpoint.init_from's config.yaml (see the module's docstring), for
    predict.py and generate.py, before the session validates it. `overrides`: the command line's (Hydra's
    overrides.task); a key it sets to another value than the saved one is a ConfigError naming both.
    A weights file, or a folder without config.yaml: `cfg` as it is."""
    file = saved_config_file(cfg.checkpoint.init_from)
    if file is None:
        return cfg
    saved = read_saved_config(file, get_recipe, expected_recipe=cfg.get("recipe"))
    explicit = explicit_keys(overrides)
    taken = {}
    for key, value in saved.model_settings.items():
        setter = _setter(key, explicit)
        has_own, given = _given(cfg, key, directly=key in explicit)
        if setter is not None and has_own and given != value:
            via = "" if key in explicit else f" (by {setter})"
            raise ConfigError(
                f"{key}={given!r} on the command line{via}, but {file} trained with {key}={value!r}: "
                "leave it out (the model's settings come from its step folder), or use a checkpoint "
                "trained with it"
            )
        if not has_own or given != value:
            taken[key] = value
    merged = copy.deepcopy(cfg)
    OmegaConf.set_readonly(merged, False)  # (a validated config is read-only; the session checks this one again)
    with open_dict(merged):
        for key, value in taken.items():
            OmegaConf.update(merged, key, value, merge=False)
    if os.environ.get("RANK", "0") == "0":
        changed = ", ".join(f"{k}={v}" for k, v in taken.items())
        log.info("model settings from %s%s", file, f" (taken over: {changed})" if taken else " (as the config's)")
    return merged
