"""A step folder's config.yaml read back: predict.py, generate.py and `checkpoint.py to-hf` take the trained
model's settings from it (a different one given on the command line is refused, naming both values), and a
config.yaml that is not a run's (an interpolation, a list, an unknown recipe or key, a wrong type, bytes that
are not UTF-8, an alias) is refused naming the file, without resolving anything in it."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from omegaconf import OmegaConf

import generate
import predict
from checkpoint import main as checkpoint_cli
from core import session
from core.checkpointing.changes import config_changes
from core.checkpointing.layout import CheckpointError
from core.checkpointing.saved_config import adopt_saved_model
from core.config.errors import ConfigError
from recipes.registry import get_recipe
from tests.recipes.vit.test_image_folders import make_quirky_imagefolder
from tests.support.helpers import REPO, compose_config, run_python, train_run, validated_config

# Model sizes and preprocessing that differ from vit_predict's (ViT-B/16 at 224 px, ImageNet normalization,
# the 0.875 validation crop).
VIT_TRAINED = [
    "model=vit_tiny",
    "model.hidden_size=48",
    "model.depth=2",
    "model.num_heads=2",
    "data.mean=[0.4,0.4,0.4]",
    "data.std=[0.3,0.3,0.3]",
    "data.val_crop_fraction=1.0",
]


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """A ViT trained 2 steps on a 3-class image folder, with VIT_TRAINED's settings."""
    tmp = tmp_path_factory.mktemp("vit")
    root, _ = make_quirky_imagefolder(tmp / "pets")
    overrides = [
        "data=imagefolder",
        f"data.root={root}",
        *VIT_TRAINED,
        "precision=fp32",
        "training.steps=2",
        "training.val_every_n_steps=0",
        "training.val_at_end=false",
        "training.micro_batch_size=12",
        "training.global_batch_size=12",
        "data.num_workers=0",
        "logger.progress_bar=never",
        "scheduler.warmup_steps=1",
    ]
    train_run(validated_config("vit_sanity", [*overrides, f"checkpoint.path={tmp}/ckpt"]), tmp / "train")
    return SimpleNamespace(root=root, ckpt=tmp / "ckpt", step=tmp / "ckpt" / "step_2", overrides=overrides)


def _predict_overrides(vit, tmp_path, *extra: str) -> list[str]:
    """vit_predict's command line for the trained ViT: the data to predict on, and no model settings."""
    return [
        "data=imagefolder",
        f"data.root={vit.root}",
        "precision=fp32",
        "data.num_workers=0",
        "predict.micro_batch_size=8",
        "logger.progress_bar=never",
        f"checkpoint.path={tmp_path}/unused",
        f"checkpoint.init_from={vit.ckpt}",
        f"predict.output={tmp_path}/predictions.csv",
        *extra,
    ]


def _predict(vit, tmp_path, *extra: str):
    overrides = _predict_overrides(vit, tmp_path, *extra)
    return predict.predict(compose_config("vit_predict", overrides), tmp_path / "run", overrides)


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_predict_takes_the_trained_model_and_preprocessing(vit, tmp_path, caplog):
    """vit_predict with the checkpoint root and no model settings predicts with the trained sizes and
    preprocessing (the same rows as with all of them repeated on the command line); the data and the neutral
    model.backend stay the command's."""
    with caplog.at_level(logging.INFO):
        result = _predict(vit, tmp_path / "taken")
    assert f"model settings from {vit.step}/config.yaml (taken over: " in caplog.text
    used = yaml.safe_load((tmp_path / "taken" / "run" / "resolved_config.yaml").read_text())
    trained = {"img_size": 28, "patch_size": 7, "hidden_size": 48, "depth": 2, "num_heads": 2, "num_classes": 3}
    assert {k: used["model"][k] for k in trained} == trained
    assert used["data"]["mean"] == [0.4] * 3 and used["data"]["std"] == [0.3] * 3
    assert used["data"]["val_crop_fraction"] == 1.0 and used["data"]["root"] == str(vit.root)
    assert result.rows == 18  # the val split the command asked for

    repeated = _predict(vit, tmp_path / "repeated", *VIT_TRAINED, "model.backend=torch")  # equal values: fine
    used = yaml.safe_load((tmp_path / "repeated" / "run" / "resolved_config.yaml").read_text())
    assert used["model"]["backend"] == "torch"
    assert _rows(repeated.output) == _rows(result.output)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.depth=4", "model.depth=4 on the command line, but {step}/config.yaml trained with model.depth=2"),
        (
            "model=vit_base_patch16_224",
            "model.img_size=224 on the command line (by model=vit_base_patch16_224), but "
            "{step}/config.yaml trained with model.img_size=28",
        ),
        (
            "data.val_crop_fraction=0.875",
            "data.val_crop_fraction=0.875 on the command line, but {step}/config.yaml "
            "trained with data.val_crop_fraction=1.0",
        ),
    ],
)
def test_a_different_model_setting_on_the_command_line_is_refused(vit, tmp_path, override, message):
    overrides = _predict_overrides(vit, tmp_path, override)
    with pytest.raises(ConfigError) as error:
        predict.predict(compose_config("vit_predict", overrides), tmp_path / "run", overrides)
    assert message.format(step=vit.step) in str(error.value)
    with pytest.raises(SystemExit) as ended:  # as the command ends: exit code 2
        session.exit_on_error(predict.predict, compose_config("vit_predict", overrides), tmp_path / "run", overrides)
    assert ended.value.code == 2


def test_the_command_reads_its_overrides_from_hydra(vit, tmp_path):
    proc = run_python(
        REPO / "predict.py",
        "--config-name",
        "vit_predict",
        *_predict_overrides(vit, tmp_path, "model.depth=4"),
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = f"model.depth=4 on the command line, but {vit.step}/config.yaml trained with model.depth=2"
    assert message in proc.stdout + proc.stderr


def test_without_the_command_line_a_config_value_is_taken_over(vit, tmp_path):
    """In-process callers that pass no overrides: nothing counts as explicit, the saved values win."""
    cfg = adopt_saved_model(
        compose_config("vit_predict", _predict_overrides(vit, tmp_path, "model.depth=4")), [], get_recipe
    )
    assert cfg.model.depth == 2 and cfg.model.hidden_size == 48


# case: (how the run's config.yaml is changed, what the error says, whether it is unreadable as plain data:
# then the resume comparison cannot compare either).
HOSTILE = {
    "an interpolation": (
        lambda text: text.replace("hidden_size: 48", "hidden_size: ${oc.env:HOME}"),
        "model.hidden_size='${oc.env:HOME}' is an interpolation",
        True,
    ),
    "our own resolver": (
        lambda text: text.replace("depth: 2", "depth: ${saved_config_probe:}"),
        "is an interpolation",
        True,
    ),
    "a list": (
        lambda text: "- " + text.replace("\n", "\n  "),
        "expected a mapping of settings at the top, found list",
        True,
    ),
    "an alias": (lambda text: text.replace("recipe: vit", "recipe: &name vit\nalso: *name"), "found an alias", True),
    "not UTF-8": (lambda text: text.replace("hidden_size: 48", "hidden_size: 48 # \udcff"), "not UTF-8", True),
    "an unknown recipe": (lambda text: text.replace("recipe: vit", "recipe: plm"), "unknown recipe 'plm'", False),
    "another recipe": (
        lambda text: text.replace("recipe: vit", "recipe: mnist"),
        "recipe: mnist, but this needs a checkpoint of the vit recipe",
        False,
    ),
    "a wrong type": (
        lambda text: text.replace("depth: 2", "depth: two"),
        "model.depth: Value 'two' of type 'str'",
        False,
    ),
    "an unknown model key": (lambda text: text.replace("  depth: 2", "  depth: 2\n  depht: 3"), "model.depht", False),
    "a value out of range": (
        lambda text: text.replace("depth: 2", "depth: 0"),
        "model.depth=0: expected an integer 1 <=",
        False,
    ),
}


@pytest.fixture
def resolver_probe():
    """A resolver that counts its calls: none may happen while a config.yaml is read."""
    calls = []
    OmegaConf.register_new_resolver("saved_config_probe", lambda: calls.append(1) or 48, replace=True)
    yield calls
    OmegaConf.clear_resolver("saved_config_probe")


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_config_yaml_that_is_not_a_runs_is_refused_naming_it(vit, tmp_path, case, resolver_probe):
    change, message, unreadable = HOSTILE[case]
    step = tmp_path / "step_2"
    step.mkdir()
    text = change((vit.step / "config.yaml").read_text())
    (step / "config.yaml").write_bytes(text.encode("utf-8", errors="surrogateescape"))
    overrides = _predict_overrides(vit, tmp_path, f"checkpoint.init_from={step}")
    with pytest.raises(CheckpointError) as error:
        adopt_saved_model(compose_config("vit_predict", overrides), overrides, get_recipe)
    assert str(step / "config.yaml") in str(error.value) and message in str(error.value), str(error.value)
    assert resolver_probe == []
    if unreadable:
        cfg = validated_config("vit_sanity", [*vit.overrides, f"checkpoint.path={tmp_path}/ckpt"])
        refused, _ = config_changes(step / "config.yaml", cfg)
        assert len(refused) == 1 and str(step / "config.yaml") in refused[0] and "cannot be compared" in refused[0]


def test_predict_ends_with_exit_code_3_on_a_hostile_config(vit, tmp_path):
    step = tmp_path / "step_2"
    shutil.copytree(vit.step, step)
    (step / "config.yaml").write_text("- recipe: vit\n")
    overrides = _predict_overrides(vit, tmp_path, f"checkpoint.init_from={step}")
    with pytest.raises(SystemExit) as ended:
        session.exit_on_error(predict.predict, compose_config("vit_predict", overrides), tmp_path / "run", overrides)
    assert ended.value.code == 3


def test_a_weights_file_leaves_the_config_as_given(vit, tmp_path):
    checkpoint_cli(["to-safetensors", str(vit.step), str(tmp_path / "vit.safetensors")])
    weights = f"checkpoint.init_from={tmp_path}/vit.safetensors"
    cfg = compose_config("vit_predict", _predict_overrides(vit, tmp_path, weights))
    assert adopt_saved_model(cfg, [], get_recipe) is cfg


def test_the_resume_comparison_reads_the_saved_config(vit, tmp_path):
    ckpt = tmp_path / "ckpt"

    def resolved(*overrides):  # as the session gives it to the checkpointer (the class count read from the data)
        cfg = validated_config("vit_sanity", [*vit.overrides, *overrides, f"checkpoint.path={ckpt}"])
        return get_recipe(cfg.recipe)(cfg).resolve_config(cfg)

    assert config_changes(vit.step / "config.yaml", resolved())[0] == []
    assert config_changes(vit.step / "config.yaml", resolved("model.depth=3"))[0] == ["model.depth: 2 -> 3"]
    # A resume from a checkpoint whose config.yaml cannot be read stops, naming it.
    shutil.copytree(vit.ckpt, ckpt)
    (ckpt / "step_2" / "config.yaml").write_text("model:\n  depth: ${oc.env:HOME}\n")
    cfg = validated_config("vit_sanity", [*vit.overrides, "training.steps=3", f"checkpoint.path={ckpt}"])
    with pytest.raises(ConfigError, match=r"step_2/config\.yaml: model\.depth='\$\{oc\.env:HOME\}' is an interpol"):
        train_run(cfg, tmp_path / "run")


def test_the_class_count_without_data_comes_from_the_saved_config(vit, tmp_path, caplog):
    from recipes.vit.recipe import ViTRecipe

    cfg = validated_config(
        "vit_sanity",
        [
            "data=imagefolder",
            f"data.root={tmp_path}/gone",
            f"checkpoint.path={tmp_path}/ckpt",
            f"checkpoint.init_from={vit.ckpt}",
        ],
    )
    with caplog.at_level(logging.INFO):
        assert ViTRecipe(cfg).resolve_config(cfg).model.num_classes == 3
    assert f"num_classes=3 from {vit.step}/config.yaml" in caplog.text
    step = tmp_path / "step_2"
    step.mkdir()
    text = (vit.step / "config.yaml").read_text()
    (step / "config.yaml").write_text(text.replace("num_classes: 3", "num_classes: -3", 1))  # the model's
    cfg = validated_config(
        "vit_sanity",
        [
            "data=imagefolder",
            f"data.root={tmp_path}/gone",
            f"checkpoint.path={tmp_path}/ckpt",
            f"checkpoint.init_from={step}",
        ],
    )
    with pytest.raises(CheckpointError, match=r"step_2/config\.yaml: model\.num_classes=-3: expected"):
        ViTRecipe(cfg).resolve_config(cfg)


# --- the GPT: generate.py and to-hf ------------------------------------------------------------------------

GPT_TRAINED = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=96",
    "model.seq_length=32",
]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """gpt_sanity shrunk to GPT_TRAINED, 2 steps."""
    tmp = tmp_path_factory.mktemp("gpt")
    overrides = [
        *GPT_TRAINED,
        "training.micro_batch_size=4",
        "training.global_batch_size=4",
        "training.steps=2",
        "training.val_every_n_steps=0",
        "training.val_at_end=false",
        "data.num_workers=0",
        "logger.progress_bar=never",
        f"data.cache_dir={tmp}/cache",
        f"checkpoint.path={tmp}/ckpt",
    ]
    train_run(validated_config("gpt_sanity", overrides), tmp / "train")
    return SimpleNamespace(tmp=tmp, step=tmp / "ckpt" / "step_2")


def test_generate_takes_the_trained_model(gpt, tmp_path):
    overrides = [
        f"checkpoint.init_from={gpt.step}",
        f"checkpoint.path={tmp_path}/unused",
        "generate.prompt='Call me'",
        "generate.greedy=true",
        "generate.max_new_tokens=4",
    ]
    out = generate.generate(compose_config("gpt_sanity", overrides), tmp_path / "run", overrides)
    assert out[0].new_tokens == 4
    used = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())["model"]
    assert (used["hidden_size"], used["num_layers"], used["ffn_hidden_size"], used["seq_length"]) == (64, 2, 96, 32)
    refused = [*overrides, "model.num_layers=4"]
    with pytest.raises(
        ConfigError,
        match=f"model.num_layers=4 on the command line, but {gpt.step}/config.yaml trained with model.num_layers=2",
    ):
        generate.generate(compose_config("gpt_sanity", refused), tmp_path / "refused", refused)


def test_to_hf_takes_the_step_folders_model_and_checks_config(gpt, tmp_path):
    checkpoint_cli(["to-hf", str(gpt.step), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (64, 2, 96)
    checkpoint_cli(["to-hf", str(gpt.step), str(tmp_path / "same"), "--config", str(gpt.step / "config.yaml")])
    other = tmp_path / "other.yaml"
    other.write_text((gpt.step / "config.yaml").read_text().replace("num_layers: 2", "num_layers: 4"))
    with pytest.raises(
        SystemExit,
        match=f"--config {other} has model.num_layers=4, but {gpt.step}/config.yaml trained with model.num_layers=2",
    ):
        checkpoint_cli(["to-hf", str(gpt.step), str(tmp_path / "differs"), "--config", str(other)])
    other.write_text((gpt.step / "config.yaml").read_text().replace("tokenizer: byte", "tokenizer: ${oc.env:HOME}"))
    with pytest.raises(SystemExit, match=f"{other}: data.tokenizer='\\$\\{{oc.env:HOME\\}}' is an interpolation"):
        checkpoint_cli(["to-hf", str(gpt.step), str(tmp_path / "hostile"), "--config", str(other)])
