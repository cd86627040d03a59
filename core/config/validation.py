"""Strict validation of a composed config, and the explicit registration of the schemas with Hydra.

`register_schemas` stores `TrainConfig` as `base_train` and each recipe's model/data schemas as
`<recipe>_model_schema` / `<recipe>_data_schema` in the `model` / `data` groups; the entry points call it
(through `recipes.registry.register_configs`) before Hydra composes. `validate` then checks a composed
config again, strictly, against the same schemas (a `+key=value` override bypasses Hydra's struct checks)
and runs the schemas' value checks, before any work.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable

from hydra.core.config_store import ConfigStore
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.config.errors import ConfigError
from core.config.schema import TrainConfig


def register_schemas(recipes: Iterable[Any]) -> None:
    """Store the schemas in Hydra's ConfigStore; `recipes` are Recipe classes (name, model_schema, data_schema)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for recipe in recipes:
        cs.store(group="model", name=f"{recipe.name}_model_schema", node=recipe.model_schema)
        cs.store(group="data", name=f"{recipe.name}_data_schema", node=recipe.data_schema)


def _recipe_schema(group: str, recipe: str) -> DictConfig:
    cs = ConfigStore.instance()
    try:
        return cs.load(f"{group}/{recipe}_{group}_schema.yaml").node
    except ConfigLoadError:
        known = sorted(n.removesuffix("_model_schema.yaml") for n in cs.list("model") if n.endswith("_model_schema.yaml"))
        raise ConfigError(f"recipe: unknown recipe {recipe!r}; known: {', '.join(known) or 'none registered'}") from None


def validate(cfg: DictConfig) -> DictConfig:
    """Check the composed config against the schemas, strictly, run the value checks, and return it
    resolved and read-only. Raises ConfigError naming the offending key (unknown key, wrong type, a value
    outside its choices, a missing value, an unusable value)."""
    recipe = cfg.get("recipe") if OmegaConf.is_dict(cfg) else None
    if not isinstance(recipe, str) or OmegaConf.is_missing(cfg, "recipe"):
        raise ConfigError("recipe: missing (e.g. recipe: vit)")
    schema = OmegaConf.structured(TrainConfig)
    schema.model = _recipe_schema("model", recipe)
    schema.data = _recipe_schema("data", recipe)
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        checked = OmegaConf.merge(schema, container)
        OmegaConf.to_container(checked, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        message = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"invalid config at '{key}': {message}") from None
    _run_checks(checked, "")
    OmegaConf.set_readonly(checked, True)
    return checked


def _run_checks(node: DictConfig, key: str) -> None:
    """Call the `check(node, key)` of every schema in the tree, parents first."""
    check = getattr(OmegaConf.get_type(node), "check", None)
    if check is not None:
        check(node, key)
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not child._is_none():
            _run_checks(child, f"{key}.{name}" if key else str(name))


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config as plain Python values (enums as their values), for files, W&B and comparisons."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, Enum):
            return value.value
        return value

    return plain(OmegaConf.to_container(cfg, resolve=True))


def save_config(cfg: DictConfig, path) -> None:
    """Write the resolved config as YAML (plain values: numbers stay numbers, choices their names)."""
    OmegaConf.save(OmegaConf.create(to_plain(cfg)), path)
