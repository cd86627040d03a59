"""A resume whose fine-tuning settings give the optimizer other parameter groups than the checkpoint's (finetune.
layer_decay or backbone_lr_scale splitting head and backbone, finetune.mode) is refused with one line naming the
settings, also with checkpoint.allow_config_changes=true (torch's own error named a missing state key); a change
that keeps the groups resumes."""

from __future__ import annotations

import pytest

from core.config.errors import ConfigError
from core.training.optim import groups_mismatch
from tests.support.helpers import train_run, validated_config

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "logger.progress_bar=never",
]


def test_groups_mismatch_compares_count_and_own_learning_rates():
    plain = [{"name": "decay", "params": []}, {"name": "no_decay", "params": []}]
    scaled = [{**g, "name": f"head.{g['name']}", "lr_scale": 1.0} for g in plain]
    assert groups_mismatch({0: {"lr", "params"}, 1: {"lr", "params"}}, plain) is None
    assert groups_mismatch({0: {"lr"}, 1: {"lr"}, 2: {"lr"}}, plain) == (
        "its optimizer state has 3 parameter groups, this run's optimizer 2 (decay, no_decay)"
    )
    assert groups_mismatch({0: {"lr"}, 1: {"lr"}}, scaled) == (
        "parameter group 0 (head.decay) has a learning-rate share of its own (lr_scale) in this run, not in the "
        "checkpoint"
    )
    assert "in the checkpoint, not in this run" in groups_mismatch({0: {"lr_scale"}, 1: {"lr_scale"}}, plain)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change,message",
    [
        (
            ["finetune.layer_decay=0.9"],
            "its optimizer state has 2 parameter groups, this run's optimizer 6 (head.decay",
        ),
        (
            ["finetune.mode=frozen", "finetune.backbone_lr_scale=0.5"],
            "parameter group 0 (head.decay) has a learning-rate share of its own (lr_scale) in this run",
        ),
        (["finetune.mode=frozen"], None),  # the same two groups, fewer members: the head's state is taken
    ],
)
def test_a_resume_that_changes_the_optimizer_groups_is_refused_naming_the_settings(tmp_path, change, message):
    ckpt = [f"checkpoint.path={tmp_path}/ckpt", "checkpoint.allow_config_changes=true"]
    train_run(validated_config("esm2_finetune_sanity", [*TINY, *ckpt, "training.steps=2"]), tmp_path / "a")
    resumed = validated_config("esm2_finetune_sanity", [*TINY, *ckpt, "training.steps=3", *change])
    if message is None:
        assert train_run(resumed, tmp_path / "b")["result"].start_step == 2
        return
    with pytest.raises(ConfigError) as error:
        train_run(resumed, tmp_path / "b")
    line = str(error.value)
    assert line.startswith(f"{tmp_path}/ckpt/step_2: {message}") and "\n" not in line
    assert "finetune.mode, finetune.head, finetune.backbone_lr_scale, finetune.layer_decay" in line
    assert f"checkpoint.init_from={tmp_path}/ckpt/step_2" in line
