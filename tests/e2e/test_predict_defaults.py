"""predict.py with nothing but checkpoint.init_from, for every shipped config: its defaults work on the config's
shipped data (the test split where the data has one, else val, said in the log), or, where the config's data has
nothing to predict on (the GPT's mock data, its chat rows), one line says so."""

from __future__ import annotations

import os

import pytest
import torch

from recipes.base import PREDICTION, lacking
from recipes.registry import get_recipe
from tests.support.helpers import REPO, compose_config, run_python, train_run, validated_config

# A tiny model of each kind of checkpoint, trained for one step on the config's data: each recipe's tiny configs
# (recipes/base.py: tiny_configs), here on the shipped data they predict on where those train on generated data.
ON_SHIPPED_DATA = {
    "vit": ("vit_sanity", ["model.hidden_size=32", "model.depth=1", "model.num_heads=2"]),
    "gpt": (
        "gpt_sanity",
        [
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_attention_heads=2",
            "model.num_query_groups=2",
            "model.ffn_hidden_size=64",
            "model.seq_length=32",
        ],
    ),
    "gpt mock": (
        "gpt_1b",
        [
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_attention_heads=2",
            "model.num_query_groups=2",
            "model.ffn_hidden_size=64",
            "model.seq_length=32",
        ],
    ),
    "gpt chat": (
        "gpt_sft_sanity",
        [
            "checkpoint.init_from=null",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_attention_heads=2",
            "model.num_query_groups=2",
            "model.ffn_hidden_size=64",
            "model.seq_length=64",
        ],
    ),
}


def _tiny() -> dict[str, tuple[str, list[str]]]:
    from recipes.registry import all_recipes

    declared = {
        case: (config, list(overrides))
        for recipe in all_recipes()
        for case, (config, overrides) in recipe.test_configs().items()
    }
    return {**declared, **ON_SHIPPED_DATA}


TINY = _tiny()
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "train_defaults")


def _kind(cfg) -> str:
    if cfg.recipe == "mnist":
        return f"mnist {cfg.model.task}"
    if cfg.recipe == "gpt" and cfg.data.format in ("mock", "chat"):
        return f"gpt {cfg.data.format}"
    return cfg.recipe


def _shipped_kinds() -> set[str]:
    return {_kind(compose_config(name, ["checkpoint.path=unused"])) for name in SHIPPED}


def test_every_kind_of_shipped_config_has_a_tiny_checkpoint_here():
    # (a recipe may declare further tiny cases, e.g. another task of its shipped config: the other tests use them)
    assert _shipped_kinds() <= set(TINY)


@pytest.mark.slow
def test_predict_with_only_a_checkpoint_works_for_every_shipped_config(tmp_path):
    needed, threads = _shipped_kinds(), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only wait on one another
    try:
        for kind, (config, model) in TINY.items():
            if kind not in needed:
                continue
            cache = [f"data.cache_dir={tmp_path}/cache"] if kind.startswith("gpt") else []
            train_run(
                validated_config(
                    config,
                    [
                        *(o.format(tmp=tmp_path) for o in model),
                        *cache,
                        "training.steps=1",
                        "training.global_batch_size=4",
                        "training.micro_batch_size=4",
                        "training.val_every_n_steps=0",
                        "training.val_at_end=false",
                        "data.num_workers=0",
                        "logger.progress_bar=never",
                        f"checkpoint.path={tmp_path}/{kind}",
                    ],
                ),
                tmp_path / f"train {kind}",
            )
    finally:
        torch.set_num_threads(threads)
    failed = []
    (tmp_path / "cwd").mkdir()
    for name in SHIPPED:
        kind = _kind(compose_config(name, ["checkpoint.path=unused"]))
        given = compose_config(name, ["checkpoint.path=unused"]).predict.split
        proc = run_python(
            REPO / "predict.py",
            "--config-name",
            name,
            f"checkpoint.init_from={tmp_path}/{kind}/step_1",
            cwd=tmp_path / "cwd",
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        out = proc.stdout + proc.stderr
        recipe = compose_config(name, ["checkpoint.path=unused"]).recipe
        if lacking(get_recipe(recipe), PREDICTION):  # a recipe that does not opt into prediction: one line says so
            ok = (
                proc.returncode == 2
                and f"config error: predict.py needs a recipe with split and predict; the {recipe} recipe has no" in out
            )
        elif kind == "gpt mock":
            ok = proc.returncode == 2 and "config error: predict.py scores documents, and data.format=mock" in out
        elif kind == "gpt chat":  # chat rows: the training run's validation is the response-only figure
            ok = proc.returncode == 2 and "config error: " in out and "data.format=chat" in out
        else:
            expected = given or {"esm2": "val", "vit": "val"}.get(kind, "test")  # data/digits has train and val only
            said = given is not None or f"predict.split is not given: predicting on the {expected} split" in out
            ok = proc.returncode == 0 and said and f"samples of the {expected} split" in out and "wrote" in out
        if not ok:
            failed.append(f"{name} (exit {proc.returncode}): {out[-1500:]}")
    assert not failed, "\n\n".join(failed)
