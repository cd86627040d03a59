"""checkpoint.monitor and training.objective.metric name metrics the run records, checked at setup before any
step (not at the first save, after training), against the metrics each recipe declares it reports."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import default_collate

from core.config.errors import ConfigError
from core.config.validation import TRAIN_METRICS, check_monitored_metrics
from core.training.length import RunLength
from core.training.schedule import StepSchedule
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import train_run, validated_config


def _recipe_configs() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each recipe's tiny configs, as it declares them (recipes/base.py: tiny_configs): one per recipe and task."""
    from recipes.registry import all_recipes

    return {case: config for recipe in all_recipes() for case, config in recipe.test_configs().items()}


RECIPE_CONFIGS = _recipe_configs()


def test_every_recipe_has_a_config_here():
    from recipes.registry import recipe_names

    assert {name.split()[0] for name in RECIPE_CONFIGS} == set(recipe_names()) >= {"vit", "mnist", "gpt", "esm2"}


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_each_recipe_declares_the_metrics_its_validation_reports(name, monkeypatch, tmp_path):
    """The declaration cannot drift from the recipe's forward and summarize_validation: evaluation of a tiny
    model on two validation samples reports exactly the declared names."""
    from core.layers.namespace import get_layers
    from core.training import evaluation
    from recipes.registry import get_recipe

    config, overrides = RECIPE_CONFIGS[name]
    cfg = validated_config(
        config,
        [
            f"checkpoint.path={tmp_path}",
            "model.backend=torch",
            "data.num_workers=0",
            *(o.format(tmp=tmp_path) for o in overrides),
        ],
    )
    recipe = get_recipe(cfg.recipe)(cfg)
    recipe.cfg = recipe.resolve_config(cfg)
    model = recipe.build_model(get_layers("torch"), torch.device("cpu"))
    val = recipe.build_datasets().val
    batch = (recipe.collate_fn() or default_collate)([val[0], val[1]])
    monkeypatch.setattr(evaluation.dist, "all_reduce", lambda tensor, group=None: None)  # one process, no group
    reported = evaluation.evaluate(
        recipe, model, [{**batch, "valid": torch.ones(2)}], contextlib.nullcontext, torch.device("cpu"), None
    )
    assert sorted(reported) == sorted(recipe.validation_metrics())


def test_the_loops_train_metrics_are_the_ones_checked(monkeypatch):
    import train

    monkeypatch.setattr(train.dist, "all_reduce", lambda tensor, group=None: None)
    run = SimpleNamespace(session=SimpleNamespace(env=SimpleNamespace(dp_group=None, dp_cp_group=None)))
    out = train.StepOutput(torch.tensor(3.0), torch.tensor(2.0), torch.tensor(1.0), 0.1)
    assert sorted(train.step_figures(run, out)) == sorted(TRAIN_METRICS)


def _check(overrides: list[str], has_val_set: bool = True, objective_required: bool = False) -> None:
    """A run of 8 steps over 2 epochs (4 samples, 1 per step)."""
    cfg = validated_config("vit_sanity", ["checkpoint.path=unused", *overrides])
    schedule = StepSchedule.from_config(cfg, RunLength(steps=8, global_batch_size=1, dataset_len=4))
    check_monitored_metrics(cfg, ("loss", "top1", "top5"), has_val_set, schedule, objective_required)


VALIDATES = ["training.val_at_end=false", "training.val_every_n_steps=0", "training.val_every_n_epochs=0"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["checkpoint.monitor=train/nope"],
            "checkpoint.monitor='train/nope' is not a metric of this run; there are: "
            "train/grad_norm, train/loss, train/lr, val/loss, val/top1, val/top5",
        ),
        (["checkpoint.monitor=val/accuracy"], "checkpoint.monitor='val/accuracy' is not a metric of this run"),
        (
            ["training.objective.metric=val/top9"],
            "training.objective.metric='val/top9' is not a metric of this run; "
            "there are: train/grad_norm, train/loss, train/lr, val/loss, val/top1, val/top5",
        ),
        (
            VALIDATES + ["checkpoint.monitor=val/loss"],
            "checkpoint.monitor='val/loss': this run never validates "
            "(training.val_at_end=false, and its 8 steps (2 epochs) reach no training.val_every_n_steps=0 or "
            "training.val_every_n_epochs=0); there are: train/grad_norm, train/loss, train/lr",
        ),
        (
            VALIDATES
            + ["training.val_every_n_steps=9", "training.val_every_n_epochs=3", "checkpoint.monitor=val/top1"],
            "checkpoint.monitor='val/top1': this run never validates",
        ),
    ],
)
def test_a_metric_the_run_never_records_is_refused(overrides, message):
    with pytest.raises(ConfigError) as error:
        _check(overrides)
    assert message in str(error.value)


def test_a_run_without_validation_set_or_validation_step():
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.monitor='val/loss': this run never validates \(it has no "
        r"validation set \(training.limit_val_batches=0\)\)",
    ):
        _check(["checkpoint.monitor=val/loss", "training.limit_val_batches=0"], has_val_set=False)
    with pytest.raises(ConfigError, match=r"never validates \(it has no validation set\)"):
        _check(["checkpoint.monitor=val/loss"], has_val_set=False)
    # A sweeper needs the objective's value; a plain run that never validates just has none.
    with pytest.raises(ConfigError, match="training.objective.metric='val/loss': this run never validates"):
        _check(VALIDATES, objective_required=True)
    _check(VALIDATES)
    for validation in ("training.val_every_n_steps=8", "training.val_every_n_epochs=2", "training.val_at_end=true"):
        _check(VALIDATES + [validation, "checkpoint.monitor=val/top5"], objective_required=True)
    _check(
        VALIDATES + ["checkpoint.monitor=train/grad_norm", "training.objective.metric=train/loss"],
        has_val_set=False,
        objective_required=True,
    )


def test_a_misspelt_monitor_stops_the_run_before_any_step(tmp_path):
    """With the default final-only save, the whole run used to train and then end without a checkpoint."""
    cfg = validated_config("vit_sanity", TINY + [f"checkpoint.path={tmp_path}/ckpt", "checkpoint.monitor=train/nope"])
    with pytest.raises(
        ConfigError,
        match="checkpoint.monitor='train/nope' is not a metric of this run; there are: "
        "train/grad_norm, train/loss, train/lr$",
    ):
        train_run(cfg, tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert not [r for r in records if "step" in r]
    assert not list((tmp_path / "ckpt").glob("step_*"))
