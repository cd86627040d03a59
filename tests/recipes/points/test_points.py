"""The points recipe (recipes/points/, docs/points.md), the tiny example of adding a recipe: its samples are
deterministic, two processes learn it on a CPU in seconds, and predict.py, which it does not opt into, says so before
any work. The tests that sweep every recipe (monitored metrics, config ranges, shipped configs) take it up without
being told."""

from __future__ import annotations

import subprocess

import pytest
import torch

from core.data.checks import assert_dataset_deterministic
from core.data.datasets import EpochIndex
from recipes.points.recipe import PointsRecipe
from tests.support.helpers import REPO, read_records, run_python, torchrun, validated_config


def test_a_sample_is_the_same_every_time_and_its_noise_new_every_epoch():
    data = PointsRecipe(validated_config("points", ["checkpoint.path=unused"])).build_datasets()
    assert_dataset_deterministic(data.train, indices=[EpochIndex(0, 5), EpochIndex(1, 5)])
    assert_dataset_deterministic(data.val, indices=range(4))
    first, second = data.train[EpochIndex(0, 5)], data.train[EpochIndex(1, 5)]
    assert torch.equal(first["y"], second["y"]) and not torch.equal(first["x"], second["x"])


@pytest.mark.slow
def test_two_processes_learn_it_and_predict_py_says_it_does_not_predict(tmp_path):
    proc = subprocess.run(
        torchrun(
            2,
            "train.py",
            "--config-name",
            "points",
            "training.steps=100",
            "training.log_every_n_steps=10",
            f"checkpoint.path={tmp_path}/ckpt",
            f"hydra.run.dir={tmp_path}/run",
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(tmp_path / "run")
    train = [r for r in records if "split" not in r and "loss" in r]
    val = [r["loss"] for r in records if r.get("split") == "val"]
    assert train[-1]["loss"] < train[0]["loss"] / 4 and val[-1] < train[0]["loss"] / 4, records
    # No tokens_per_sample or flops_per_sample declared: no tokens/s and no MFU in the log.
    assert "samples_per_sec_per_gpu" in train[-1] and not {"tokens_per_sec_per_gpu", "mfu"} & set(train[-1])

    proc = run_python(REPO / "predict.py", f"checkpoint.init_from={tmp_path}/ckpt/step_100", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and out.strip().splitlines()[-1].endswith(
        "config error: predict.py needs a recipe with split and predict; the points recipe has no split and no "
        "predict (recipes/base.py)"
    ), out
    assert "predicting" not in out and "Traceback" not in out


def test_more_points_than_memory_holds_is_refused_before_any_work():
    """Each count valid, their product not: the points were allocated at once, failing with a traceback."""
    from core.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.train_points=2000000000 \+ data.val_points=128 points of data.dims="):
        validated_config("points", ["checkpoint.path=unused", "data.dims=65536", "data.train_points=2000000000"])
    assert validated_config("points", ["checkpoint.path=unused", "data.dims=2048"]).data.dims == 2048
