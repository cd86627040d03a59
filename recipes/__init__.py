"""Recipe registry: `recipe: <name>` in a config selects the class recipes.<name>.RECIPE."""

from __future__ import annotations

import importlib

from hydra.core.config_store import ConfigStore

from recipes.base import Recipe

KNOWN_RECIPES = ("vit", "mnist", "gpt")


def get_recipe(name: str) -> type[Recipe]:
    if name not in KNOWN_RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(KNOWN_RECIPES)}")
    return importlib.import_module(f"recipes.{name}").RECIPE


def _register_schemas() -> None:
    """Each recipe's model/data schemas become `<recipe>_model_schema` / `<recipe>_data_schema` in
    the `model` / `data` groups, for the group YAML files to start their defaults list with."""
    cs = ConfigStore.instance()
    for name in KNOWN_RECIPES:
        recipe = get_recipe(name)
        cs.store(group="model", name=f"{name}_model_schema", node=recipe.model_schema)
        cs.store(group="data", name=f"{name}_data_schema", node=recipe.data_schema)


_register_schemas()
