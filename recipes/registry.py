"""Recipe registry: `recipe: <name>` in a config selects the class `recipes/<name>/recipe.py:RECIPE`.

The entry points call `register_configs()` once before Hydra composes: it stores the schemas (the core's
and each recipe's model and data schemas) in Hydra's ConfigStore. Nothing is registered on import.
"""

from __future__ import annotations

import importlib

from core.config.errors import ConfigError
from core.config.validation import register_schemas
from recipes.base import Recipe

KNOWN_RECIPES = ("vit", "mnist", "gpt")


def get_recipe(name: str) -> type[Recipe]:
    if name not in KNOWN_RECIPES:
        raise ConfigError(f"recipe: unknown recipe {name!r}; known: {', '.join(KNOWN_RECIPES)}")
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE


def config_keys() -> set[str]:
    """Every dotted key a config may set: the core's schema and each recipe's model and data schemas."""
    from core.config.overrides import schema_keys
    from core.config.schema import TrainConfig

    keys = schema_keys(TrainConfig)
    for name in KNOWN_RECIPES:
        recipe = get_recipe(name)
        keys |= schema_keys(recipe.model_schema, "model.") | schema_keys(recipe.data_schema, "data.")
    return keys


def register_configs() -> None:
    """Register every schema with Hydra (idempotent)."""
    register_schemas(get_recipe(name) for name in KNOWN_RECIPES)
