"""Bad configs fail before any work, with a message that names the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.config.errors import ConfigError
from core.config.validation import validate
from core.data.sampling import accumulation_steps
from core.distributed.env import mesh_shape
from tests.helpers import REPO, compose_config


def run_train(*overrides: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "--config-name", "vit_sanity", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override,key", [
    ("optim.lrr=1", "optim.lrr"),                       # unknown key
    ("training.steps=abc", "training.steps"),           # wrong type
    ("model.hidden_size=big", "model.hidden_size"),     # wrong type in a recipe's group
    ("+optim.foo=1", "optim.foo"),                      # forced new key: caught by our validation
    ("+model.dropout=0.1", "model.dropout"),
    ("distributed.mfsdp.zero_dp_strategy=x", "distributed.mfsdp.zero_dp_strategy"),
])
def test_cli_rejects_bad_key_or_type(override, key, tmp_path):
    proc = run_train(override, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert key in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing ran


def test_validate_names_missing_value():
    cfg = compose_config("vit_sanity", ["checkpoint.path=x", "optim.lr=???"])
    with pytest.raises(ConfigError, match="optim.lr"):
        validate(cfg)


def test_mesh_must_cover_world():
    assert mesh_shape(8, 1, -1, 2) == (1, 4, 2)
    assert mesh_shape(8, 2, 2, 2) == (2, 2, 2)
    with pytest.raises(ConfigError, match="world size is 4"):
        mesh_shape(4, 1, 3, 1)
    with pytest.raises(ConfigError, match="not divisible"):
        mesh_shape(6, 1, -1, 4)
    with pytest.raises(ConfigError, match="positive"):
        mesh_shape(2, 0, 2, 1)


def test_global_batch_must_divide():
    assert accumulation_steps(64, 8, 2) == 4
    with pytest.raises(ValueError, match="global_batch_size=60 is not divisible"):
        accumulation_steps(60, 8, 2)


def test_cli_mesh_error_is_clear(tmp_path):
    proc = run_train("distributed.dp_shard=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "world size is 1" in proc.stdout + proc.stderr


def test_cli_mfsdp_on_cpu_is_refused(tmp_path):
    proc = run_train("distributed=mfsdp", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "mfsdp needs CUDA" in proc.stdout + proc.stderr


def test_cli_fp8_without_transformer_engine_is_refused(tmp_path):
    proc = run_train("precision=fp8", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "precision.fp8.enabled needs TransformerEngine" in proc.stdout + proc.stderr


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_vit_base_runs_as_typed_on_1_to_8_gpus(gpus):
    """The README's ViT command (distributed.dp_shard=NGPU) keeps the fast micro-batch of 256 on 1-8 GPUs:
    the global batch divides into it, with 8 / NGPU accumulated micro-batches."""
    cfg = validate(compose_config("vit_base_patch16_224", [f"distributed.dp_shard={gpus}", "checkpoint.path=./ckpts/vit"]))
    t = cfg.training
    assert t.micro_batch_size == 256
    assert accumulation_steps(t.global_batch_size, t.micro_batch_size, gpus) * gpus == 8
