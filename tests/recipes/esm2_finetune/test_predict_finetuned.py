"""predict.py on a LoRA or frozen-backbone step folder with only checkpoint.init_from: the fine-tuning settings that
shape the model (finetune.mode, finetune.head, finetune.lora.*) come from the step folder's config.yaml as the model's
do (core/checkpointing/saved_config.py), so the adapters are built and loaded and the rows are the trained model's;
a different finetune setting on the command line is refused as a different model setting is."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

import predict
from core.checkpointing.saved_config import adopt_saved_model
from core.config.errors import ConfigError
from recipes.registry import get_recipe
from tests.support.helpers import compose_config, read_records, train_run, validated_config

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "training.steps=4",
    "training.val_every_n_steps=0",
    "optim.lr=2e-2",
    "scheduler.warmup_steps=1",
    "logger.progress_bar=never",
]
MODES = {
    "lora": [
        "finetune.mode=lora",
        "finetune.lora.rank=4",
        "finetune.lora.alpha=8",
        "finetune.lora.target_modules=[layernorm_qkv,proj]",
        "model.task=classification",
        "data.label_columns=[charge_class]",
    ],
    "frozen": ["finetune.mode=frozen", "model.task=residue_classification", "data.label_columns=[structure]"],
}
METRIC = {"lora": "macro_f1", "frozen": "accuracy"}


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module", params=list(MODES))
def trained(request, tmp_path_factory):
    """A tiny esm2_finetune run of 4 steps in `mode` (one process), validated at its end."""
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = validated_config("esm2_finetune_sanity", [*TINY, *MODES[request.param], f"checkpoint.path={tmp}/ckpt"])
    train_run(cfg, tmp / "train")
    (validation,) = [r for r in read_records(tmp / "train") if r.get("split") == "val"]
    return request.param, tmp, validation


def _predict(tmp: Path, out: str, *extra: str):
    overrides = [
        f"checkpoint.init_from={tmp}/ckpt/step_4",
        "predict.split=val",
        f"predict.output={tmp}/{out}/p.csv",
        "checkpoint.path=unused",
        "logger.progress_bar=never",
        *extra,
    ]
    return predict.predict(compose_config("esm2_finetune_sanity", overrides), tmp / out / "run", overrides)


@pytest.mark.slow
def test_predict_with_only_init_from_builds_the_trained_finetuned_model(trained, caplog):
    """Only checkpoint.init_from (the config's own finetune.mode=full): the step folder's finetune settings are taken
    over, the LoRA weights load (strictly: none left out), and the rows are those of predict.py given the training's
    finetune settings again, with the metrics the training's own validation of the same weights gave."""
    mode, tmp, validation = trained
    with caplog.at_level(logging.INFO):
        plain = _predict(tmp, "plain")
    assert f"finetune.mode={mode}" in caplog.text.split("taken over: ", 1)[1].splitlines()[0]
    if mode == "lora":
        assert "finetune.mode=lora: " in caplog.text and "LoRA rank 4 on 2 modules" in caplog.text
    repeated = _predict(tmp, "repeated", *MODES[mode][:-2])
    assert _rows(plain.output) == _rows(repeated.output) and len(_rows(plain.output)) > 0
    assert plain.metrics[METRIC[mode]] == pytest.approx(validation[METRIC[mode]], rel=1e-6)


@pytest.mark.slow
def test_a_different_finetune_setting_on_the_command_line_is_refused(trained):
    mode, tmp, _ = trained
    other = {"lora": "finetune.lora.rank=8", "frozen": "finetune.mode=full"}[mode]
    key, value = other.split("=")
    saved = {"lora": "4", "frozen": "'frozen'"}[mode]
    overrides = [f"checkpoint.init_from={tmp}/ckpt/step_4", "checkpoint.path=unused", other]
    with pytest.raises(ConfigError) as error:
        adopt_saved_model(compose_config("esm2_finetune_sanity", overrides), overrides, get_recipe)
    shown = value if key.endswith("rank") else repr(value)
    assert f"{key}={shown} on the command line, but {tmp}/ckpt/step_4/config.yaml trained with {key}={saved}" in str(
        error.value
    )
