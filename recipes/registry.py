"""Recipe registry: `recipe: <name>` in a config selects the class `recipes/<name>/recipe.py:RECIPE`; every folder
with a recipe.py is a recipe (no list to add it to).

The entry points call `register_configs()` once before Hydra composes: it stores the schemas (the core's
and each recipe's model and data schemas) in Hydra's ConfigStore. Nothing is registered on import.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

from core.config.errors import ConfigError
from core.config.validation import register_schemas
from recipes.base import Recipe, require

RECIPES_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = RECIPES_DIR.parent / "configs"


def recipe_names() -> tuple[str, ...]:
    """Every recipe: the folders recipes/<name>/ that hold a recipe.py, sorted."""
    return tuple(sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.py")))


def get_recipe(name: str) -> type[Recipe]:
    """The class `recipe: <name>` selects (recipes/<name>/recipe.py:RECIPE)."""
    known = recipe_names()
    if name not in known:
        raise ConfigError(f"recipe: unknown recipe {name!r}; known: {', '.join(known)}")
    module = importlib.import_module(f"recipes.{name}.recipe")
    recipe = getattr(module, "RECIPE", None)
    if not (isinstance(recipe, type) and issubclass(recipe, Recipe)) or recipe.name != name:
        raise ConfigError(
            f"recipe: recipes/{name}/recipe.py must end with RECIPE = <its Recipe subclass>, whose "
            f"name is {name!r} (found {recipe!r})"
        )
    return recipe


def all_recipes() -> list[type[Recipe]]:
    return [get_recipe(name) for name in recipe_names()]


def predict_configs() -> dict[str, str]:
    """The config predict.py and generate.py compose for a checkpoint of each recipe when neither the command line nor
    the checkpoint names one (its step folder names the config it was trained with since this tool records it): the
    recipe's `predict_config`, else configs/<name>.yaml."""
    return {recipe.name: recipe.predict_config or recipe.name for recipe in all_recipes()}


def hf_conversions() -> dict[str, ModuleType]:
    """The recipes with a Hugging Face conversion (recipes/<name>/hf.py, with export_to_hf, import_from_hf and
    HF_MODEL_TYPES: the config.json model_type values it imports), by name: what `checkpoint.py to-hf` and `from-hf`
    take."""
    found = {}
    for name in recipe_names():
        if importlib.util.find_spec(f"recipes.{name}.hf") is not None:
            module = importlib.import_module(f"recipes.{name}.hf")
            if all(hasattr(module, attr) for attr in ("export_to_hf", "import_from_hf", "HF_MODEL_TYPES")):
                found[name] = module
    return found


def hf_weights_reader(name: str) -> Optional[Callable[..., dict]]:
    """The recipe's converter of a Hugging Face folder into its weights, in memory (recipes/<name>/hf.py:
    weights_from_hf_folder(folder, model settings)), for checkpoint.init_from=<a Hugging Face folder>; None where
    the recipe has none."""
    if importlib.util.find_spec(f"recipes.{name}.hf") is None:
        return None
    return getattr(importlib.import_module(f"recipes.{name}.hf"), "weights_from_hf_folder", None)


def config_keys(argv: Optional[list[str]] = None) -> set[str]:
    """Every dotted key a config may set: the core's schema and the recipes' model and data schemas; given a
    command line, only the recipe's it selects (`recipe=...`, or the `recipe:` of its --config-name file) where
    that can be told, so that a misspelt key is matched against the keys of the run's own recipe."""
    from core.config.overrides import schema_keys
    from core.config.schema import TrainConfig

    keys = schema_keys(TrainConfig)
    selected = recipe_on_command_line(argv) if argv is not None else None
    for name in (selected,) if selected in recipe_names() else recipe_names():
        recipe = get_recipe(name)
        keys |= schema_keys(recipe.model_schema, "model.") | schema_keys(recipe.data_schema, "data.")
    return keys


def recipe_on_command_line(argv: list[str]) -> Optional[str]:
    """The recipe a command line runs: its `recipe=` override, else the `recipe:` of the configs/ file its
    --config-name (-cn) names; None when it does not say."""
    from omegaconf import OmegaConf

    name = None
    for i, arg in enumerate(argv):
        if arg.startswith("recipe="):
            return arg.split("=", 1)[1]
        for flag in ("--config-name", "-cn"):
            if arg == flag and i + 1 < len(argv):
                name = argv[i + 1]
            elif arg.startswith(flag + "="):
                name = arg.split("=", 1)[1]
    file = CONFIGS_DIR / f"{name}.yaml" if name else None
    if file is None or not file.is_file():
        return None
    try:
        recipe = OmegaConf.load(file).get("recipe")
    except Exception:  # noqa: BLE001 - a config Hydra will refuse with its own message
        return None
    return recipe if isinstance(recipe, str) else None


def register_configs() -> None:
    """Register every schema with Hydra (idempotent)."""
    register_schemas(all_recipes())


def check_supports(cfg, protocol: tuple[str, ...], tool: str) -> None:
    """For predict.py and generate.py, before any work: ConfigError when the config's recipe lacks the opt-in
    `protocol` (recipes/base.py: PREDICTION, GENERATION). A config without a known recipe is left to validation."""
    from omegaconf import OmegaConf

    name = None if OmegaConf.is_missing(cfg, "recipe") else cfg.get("recipe")
    if isinstance(name, str) and name in recipe_names():
        require(get_recipe(name), protocol, tool)
