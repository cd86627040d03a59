"""Strict validation of a composed config, and the explicit registration of the schemas with Hydra.

`register_schemas` stores `TrainConfig` as `base_train` and each recipe's model/data schemas in the `model` / `data`
groups, named by `command_line.schema_name` (`<recipe>_model_schema` / `<recipe>_data_schema`); the entry points call it
(through `recipes.registry.register_configs`) before Hydra composes. `validate` then checks a composed
config again, strictly, against the same schemas (a `+key=value` override bypasses Hydra's struct checks)
and runs the schemas' value checks (their RANGES tables, then their `check` methods), before any work.
`check_monitored_metrics` checks the keys that name a metric against the metrics the run will record, once the
recipe and its data are known.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, Iterable, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.config.command_line import other_recipes_option, recipe_of_schema_name, schema_name, schema_of_option
from core.config.errors import ConfigError
from core.config.ranges import rules_of
from core.config.schema import TrainConfig

if TYPE_CHECKING:
    from core.training.schedule import StepSchedule


def register_schemas(recipes: Iterable[Any]) -> None:
    """Store the schemas in Hydra's ConfigStore; `recipes` are Recipe classes (name, model_schema, data_schema)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for recipe in recipes:
        for group, schema in (("model", recipe.model_schema), ("data", recipe.data_schema)):
            cs.store(group=group, name=schema_name(recipe.name, group), node=schema)


def _recipe_schema(group: str, recipe: str) -> DictConfig:
    cs = ConfigStore.instance()
    try:
        return cs.load(f"{group}/{schema_name(recipe, group)}.yaml").node
    except ConfigLoadError:
        known = sorted(filter(None, (recipe_of_schema_name("model", n) for n in cs.list("model"))))
        raise ConfigError(
            f"recipe: unknown recipe {recipe!r}; known: {', '.join(known) or 'none registered'}"
        ) from None


def _recipe_of_schema(group: str, schema: type) -> Optional[str]:
    """The recipe whose `group` schema (as stored by register_schemas) is `schema`, or None."""
    cs = ConfigStore.instance()
    for name in cs.list(group):
        owner = recipe_of_schema_name(group, name)
        if owner is not None and OmegaConf.get_type(cs.load(f"{group}/{name}").node) is schema:
            return owner
    return None


def _chosen(group: str) -> Optional[str]:
    """The option Hydra composed for `group` (e.g. moby_dick), when this runs under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    choice = HydraConfig.get().runtime.choices.get(group)
    return choice if isinstance(choice, str) else None


def check_recipe_groups(cfg: DictConfig, recipe: str) -> None:
    """The model and data sections must be made for the config's recipe: an option of another recipe's group (vit_sanity
    data=moby_dick) is refused naming the group, the recipe it is for and the options there are for this one, before
    its missing keys surface as interpolation errors of keys the user never set."""
    for group in ("model", "data"):
        node = cfg._get_node(group) if group in cfg else None
        owner = _recipe_of_schema(group, OmegaConf.get_type(node)) if isinstance(node, DictConfig) else None
        if owner is None or owner == recipe:
            continue
        chosen = _chosen(group)
        given = (
            f"{group}={chosen}" if chosen and schema_of_option(group, chosen) == schema_name(owner, group) else group
        )
        raise ConfigError(other_recipes_option(group, given, owner, recipe))


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
    check_recipe_groups(cfg, recipe)
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
    """For every schema in the tree, parents first: apply its RANGES table, then call its `check(node, key)`."""
    schema = OmegaConf.get_type(node)
    for name, rule in rules_of(schema).items():
        rule.check(node[name], f"{key}.{name}" if key else name)
    check = getattr(schema, "check", None)
    if check is not None:
        check(node, key)
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not child._is_none():
            _run_checks(child, f"{key}.{name}" if key else str(name))


# What the training loop records as train/<name> at its logging and saving steps (train.step_figures).
TRAIN_METRICS = ("loss", "lr", "grad_norm")


def check_monitored_metrics(
    cfg: DictConfig, val_metrics: Iterable[str], has_val_set: bool, schedule: StepSchedule, objective_required: bool
) -> None:
    """checkpoint.monitor and training.objective.metric must name a metric the run records: train/<TRAIN_METRICS>,
    or val/<one of `val_metrics`> (the recipe's) when the run validates: it has a validation set, and its
    `schedule` (the loop's) validates at some step. Checked before any work: otherwise a misspelt monitor is
    found at the first save, after training. The objective's value is needed only when a sweeper optimises it
    (`objective_required`); a plain run may leave it unrecorded."""
    training = cfg.training
    steps, epochs = schedule.length.steps, schedule.length.epochs_done(schedule.length.steps)
    if not has_val_set:
        no_validation = "it has no validation set" + (
            " (training.limit_val_batches=0)" if training.limit_val_batches == 0 else ""
        )
    elif schedule.validates_at_all():
        no_validation = None
    else:
        no_validation = (
            f"training.val_at_end=false, and its {steps} steps ({epochs} epochs) reach no "
            f"training.val_every_n_steps={training.val_every_n_steps} or training.val_every_n_epochs="
            f"{training.val_every_n_epochs}"
        )
    train_names = sorted(f"train/{name}" for name in TRAIN_METRICS)
    for key, metric, needs_validation in (
        ("checkpoint.monitor", cfg.checkpoint.monitor, True),
        ("training.objective.metric", training.objective.metric, objective_required),
    ):
        validates = not (needs_validation and no_validation)
        known = train_names + (sorted(f"val/{name}" for name in val_metrics) if validates else [])
        if not metric or metric in known:
            continue
        if metric.startswith("val/") and not validates:
            raise ConfigError(
                f"{key}={metric!r}: this run never validates ({no_validation}); there are: {', '.join(known)}"
            )
        raise ConfigError(f"{key}={metric!r} is not a metric of this run; there are: {', '.join(known)}")


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
