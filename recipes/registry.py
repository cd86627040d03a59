"""Recipe registry: `recipe: <name>` in a config selects the class `recipes/<name>/recipe.py:RECIPE`.

The entry points call `register_configs()` once before Hydra composes: it stores the schemas (the core's
and each recipe's model and data schemas) in Hydra's ConfigStore. Nothing is registered on import.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional

from core.config.errors import ConfigError
from core.config.validation import register_schemas
from recipes.base import Recipe

KNOWN_RECIPES = ("vit", "mnist", "gpt", "esm2")
# The config predict.py and generate.py compose for a checkpoint of the recipe when neither the command line nor the
# checkpoint names one (its step folder names the config it was trained with since this tool records it).
PREDICT_CONFIGS = {"vit": "vit_predict", "mnist": "mnist_predict", "gpt": "gpt_sanity", "esm2": "esm2_sanity"}
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def get_recipe(name: str) -> type[Recipe]:
    if name not in KNOWN_RECIPES:
        raise ConfigError(f"recipe: unknown recipe {name!r}; known: {', '.join(KNOWN_RECIPES)}")
    return importlib.import_module(f"recipes.{name}.recipe").RECIPE


def hf_conversions() -> dict[str, ModuleType]:
    """The recipes with a Hugging Face conversion (recipes/<name>/hf.py, with export_to_hf and import_from_hf), by
    name: what `checkpoint.py to-hf` and `from-hf` take."""
    found = {}
    for name in KNOWN_RECIPES:
        if importlib.util.find_spec(f"recipes.{name}.hf") is not None:
            module = importlib.import_module(f"recipes.{name}.hf")
            if hasattr(module, "export_to_hf") and hasattr(module, "import_from_hf"):
                found[name] = module
    return found


def config_keys(argv: Optional[list[str]] = None) -> set[str]:
    """Every dotted key a config may set: the core's schema and the recipes' model and data schemas; given a
    command line, only the recipe's it selects (`recipe=...`, or the `recipe:` of its --config-name file) where
    that can be told, so that a misspelt key is matched against the keys of the run's own recipe."""
    from core.config.overrides import schema_keys
    from core.config.schema import TrainConfig

    keys = schema_keys(TrainConfig)
    selected = recipe_on_command_line(argv) if argv is not None else None
    for name in (selected,) if selected in KNOWN_RECIPES else KNOWN_RECIPES:
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
    register_schemas(get_recipe(name) for name in KNOWN_RECIPES)
