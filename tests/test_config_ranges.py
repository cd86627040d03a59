"""Every number in a config is range-checked when the config is validated, before any work, with the key,
the value and the allowed range named; and preprocessing errors name the file and the position."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from core.config.errors import ConfigError
from tests.helpers import CONFIGS, validated_config

BAD = [
    ("vit_sanity", "training.micro_batch_size=-4", "training.micro_batch_size=-4: expected >= 1"),
    ("vit_sanity", "training.micro_batch_size=0", "training.micro_batch_size=0: expected >= 1"),
    ("vit_sanity", "training.steps=0", "training.steps=0: expected >= 1"),
    ("vit_sanity", "training.epochs=2", "training.steps=300 and training.epochs=2 both give the run's length: give one"),
    ("vit_sanity", "training.steps=null", "training.steps or training.epochs: give one"),
    ("vit_sanity", "training.val_every_n_epochs=-1", "training.val_every_n_epochs=-1: expected >= 0"),
    ("vit_sanity", "training.global_batch_size=0", "training.global_batch_size=0: expected >= 1"),
    ("vit_sanity", "training.log_every_n_steps=0", "training.log_every_n_steps=0: expected >= 1"),
    ("vit_sanity", "training.val_every_n_steps=-1", "training.val_every_n_steps=-1: expected >= 0"),
    ("vit_sanity", "optim.lr=0", "optim.lr=0.0: expected a finite number > 0"),
    ("vit_sanity", "optim.lr=-1", "optim.lr=-1.0: expected a finite number > 0"),
    ("vit_sanity", "optim.lr=nan", "optim.lr=nan: expected a finite number > 0"),
    ("vit_sanity", "optim.lr=inf", "optim.lr=inf: expected a finite number > 0"),
    ("vit_sanity", "optim.weight_decay=-0.1", "optim.weight_decay=-0.1: expected a finite number >= 0"),
    ("vit_sanity", "optim.eps=0", "optim.eps=0.0: expected a finite number > 0"),
    ("vit_sanity", "optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0]: expected values in [0, 1)"),
    ("vit_sanity", "optim.max_grad_norm=nan", "optim.max_grad_norm=nan: expected a finite number >= 0"),
    ("vit_sanity", "scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio=2.0: expected a number in [0, 1]"),
    ("vit_sanity", "scheduler.warmup_steps=-1", "scheduler.warmup_steps=-1: expected >= 0"),
    ("vit_sanity", "distributed.tp=0", "distributed.tp=0: expected >= 1"),
    ("vit_sanity", "distributed.dp_shard=0", "distributed.dp_shard=0: expected -1 (what is left) or >= 1"),
    ("vit_sanity", "distributed.timeout_minutes=inf", "distributed.timeout_minutes=inf: expected a finite number > 0"),
    ("vit_sanity", "precision.fp8.amax_history_len=0", "precision.fp8.amax_history_len=0: expected >= 1"),
    ("vit_sanity", "checkpoint.write_threads=0", "checkpoint.write_threads=0: expected >= 1"),
    ("vit_sanity", "checkpoint.save_every_n_steps=-5", "checkpoint.save_every_n_steps=-5: expected >= 0"),
    ("vit_sanity", "seed=-1", "seed=-1: expected 0 <= seed < 2**31"),
    ("vit_sanity", "data.num_workers=-1", "data.num_workers=-1: expected >= 0"),
    ("vit_sanity", "data.hflip=2", "data.hflip=2.0: expected a finite number in [0, 1]"),
    ("vit_sanity", "model.depth=0", "model.depth=0: expected a finite number > 0"),
    ("vit_sanity", "model.hidden_dropout=1.5", "model.hidden_dropout=1.5: expected a finite number in [0, 1]"),
    ("gpt_sanity", "model.seq_length=0", "model.seq_length=0: expected a finite number > 0"),
    ("gpt_sanity", "model.norm_epsilon=nan", "model.norm_epsilon=nan: expected a finite number > 0"),
    ("mnist_pretrain", "model.latent_size=0", "model.latent_size=0: expected a finite number > 0"),
]


@pytest.mark.parametrize("config,override,message", BAD, ids=[o for _, o, _ in BAD])
def test_a_number_out_of_range_is_refused_naming_its_key(config, override, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        validated_config(config, [f"checkpoint.path={tmp_path}", override])
    assert message in str(error.value)


@pytest.mark.parametrize("config", sorted(Path(p).stem for p in glob.glob(str(CONFIGS / "*.yaml"))
                                          if Path(p).stem != "train_defaults"))
def test_the_shipped_configs_pass(config, tmp_path):
    validated_config(config, [f"checkpoint.path={tmp_path}"])


def test_preprocessing_names_the_file_and_position_of_binary_input(tmp_path):
    from recipes.gpt.preprocess import read_documents

    text = tmp_path / "notes.txt"
    text.write_bytes(b"a paragraph\n\nanother\n\xff\xfe binary")
    with pytest.raises(ValueError, match=rf"{text}:4: not UTF-8 text \(byte 21 of the file"):
        list(read_documents(text))
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n{"text": "\xc3("}\n')
    with pytest.raises(ValueError, match=rf"{lines}:2: not UTF-8 text"):
        list(read_documents(lines))
