"""The MNIST recipe: datasets, weights carried from pretraining to fine-tuning, and the three-command
workflow (pretrain -> fine-tune -> predict) on 2 and 3 processes."""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from core.data.checks import assert_dataset_deterministic
from core.data.datasets import MultiEpochDatasetResampler
from tests.support.checkpoint_harness import run_phases
from tests.support.helpers import REPO, run_python, run_python_ranks, run_workers

RAW = REPO / "data" / "mnist_5k" / "MNIST" / "raw"
QUICK = ["logger.progress_bar=never", "training.log_every_n_steps=10", "data.num_workers=0"]


def mnist_recipe(config: str = "mnist_pretrain", overrides: list[str] = ()):
    from recipes.mnist.recipe import MNISTRecipe
    from tests.support.helpers import validated_config

    return MNISTRecipe(validated_config(config, ["checkpoint.path=unused", *overrides]))


def test_splits_are_fixed_disjoint_and_deterministic():
    from recipes.mnist.data import read_mnist_file

    recipe = mnist_recipe()
    train, val, test = (recipe.split(s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (3667, 333, 1000)  # 4,000 training-file images: 1/12 held out
    train_rows = [train[i]["idx"] for i in range(len(train))]
    val_rows = [val[i]["idx"] for i in range(len(val))]
    test_rows = [test[i]["idx"] for i in range(len(test))]
    assert sorted(train_rows + val_rows) == list(range(4000))  # disjoint, together the whole file
    assert sorted(test_rows) == list(range(1000)) and test_rows != sorted(test_rows)  # shuffled, each once
    again, reseeded = mnist_recipe().split("val"), mnist_recipe(overrides=["data.val_seed=7"]).split("val")
    assert val_rows == [again[i]["idx"] for i in range(len(val))]  # the same split and order again
    assert val_rows != [reseeded[i]["idx"] for i in range(len(val))]  # another order from another seed
    assert sorted(val_rows) == sorted(reseeded[i]["idx"] for i in range(len(val)))

    images, labels = read_mnist_file(str(REPO / "data" / "mnist_5k"), False, False)
    sample = test[3]
    assert sample["data"].shape == (1, 28, 28) and 0 <= sample["data"].min() and sample["data"].max() <= 1
    assert (
        torch.equal(sample["data"][0], images[sample["idx"]].float() / 255) and sample["label"] == labels[sample["idx"]]
    )

    stream = MultiEpochDatasetResampler(train, num_epochs=2, seed=1)  # as the training loop reads it
    assert_dataset_deterministic(stream, indices=[0, 17, len(train) + 17, 2 * len(train) - 1])
    assert_dataset_deterministic(val)
    assert_dataset_deterministic(test)


def test_missing_truncated_and_foreign_files_give_clear_errors(tmp_path):
    from recipes.mnist.data import read_idx, read_mnist_file

    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\[\.gz\].*data.download=true"):
        read_mnist_file(str(tmp_path / "nothing"), True, False)
    cut = tmp_path / "t10k-images-idx3-ubyte.gz"
    cut.write_bytes(gzip.compress(gzip.decompress((RAW / "t10k-images-idx3-ubyte.gz").read_bytes())[:5000]))
    with pytest.raises(
        ValueError, match=r"t10k-images-idx3-ubyte.gz: 4984 bytes of data, but the header says \(1000, 28, 28\)"
    ):
        read_idx(cut)
    other = tmp_path / "t10k-labels-idx1-ubyte"
    other.write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(other)


def _phase(config: str, tmp: Path, name: str, extra: list[str], **kw) -> dict:
    return {
        "config": config,
        "overrides": QUICK + [f"checkpoint.path={tmp}/{name}", *extra],
        "run_dir": f"{tmp}/{name}_run",
        **kw,
    }


@pytest.mark.slow
def test_finetune_takes_the_pretrained_trunk_and_a_fresh_head(tmp_path):
    """init_from the autoencoder: trunk weights equal the pretrained ones, digit_classifier keeps its
    fresh initialisation, the decoder (not in this model) is left out; without init_ignore_unexpected
    the decoder is an error that lists it."""
    # An lr of 1e-30 moves a weight by ~1e-30: the loaded weights stay (a zero one becomes ~1e-30).
    lr0 = ["training.steps=1", "optim.lr=1e-30", "training.val_at_end=false"]
    step_dir = tmp_path / "pre" / "step_20"
    pre, fresh, tuned, strict = run_workers(
        1,
        run_phases,
        [
            _phase("mnist_pretrain", tmp_path, "pre", ["training.steps=20", "training.val_at_end=false"], state=True),
            _phase("mnist_finetune", tmp_path, "fresh", lr0, state=True),
            _phase("mnist_finetune", tmp_path, "tuned", lr0 + [f"checkpoint.init_from={step_dir}"], state=True),
            _phase(
                "mnist_finetune",
                tmp_path,
                "strict",
                lr0 + [f"checkpoint.init_from={step_dir}", "checkpoint.init_ignore_unexpected=false"],
                expect_error=True,
            ),
        ],
    )[0]
    assert sorted(tuned["state"]) == [
        "digit_classifier.bias",
        "digit_classifier.weight",
        "trunk.fc1.bias",
        "trunk.fc1.weight",
        "trunk.fc2.bias",
        "trunk.fc2.weight",
    ]
    for name, value in tuned["state"].items():
        origin = fresh if name.startswith("digit_classifier.") else pre
        assert torch.allclose(value, origin["state"][name], rtol=0, atol=1e-25), name
    assert not torch.equal(pre["state"]["trunk.fc1.weight"], fresh["state"]["trunk.fc1.weight"])  # it trained
    assert "unexpected in the checkpoint: ['decoder.fc1.bias', 'decoder.fc1.weight'" in strict["error"]


def _on_ranks(nproc: int, script: str, config: str, cwd: Path, *overrides: str) -> str:
    """The command on `nproc` processes, as torchrun runs it (torchrun itself: tests/e2e/)."""
    proc = run_python_ranks(nproc, REPO / script, "--config-name", config, *overrides, cwd=cwd)
    assert proc.returncode == 0, f"{script} {config} {overrides}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_pretrain_finetune_predict_commands(tmp_path):
    """docs/mnist.md's three commands on the shipped digits: pretrain and fine-tune on 2 processes, predict
    on 3 (1,000 test samples do not divide by 3): one row per test sample, accuracy well above chance;
    the same fine-tune command again finds its checkpoint and has nothing left to do."""
    _on_ranks(
        2,
        "train.py",
        "mnist_pretrain",
        tmp_path,
        "checkpoint.path=ckpt/pre",
        "training.steps=200",
        "scheduler.warmup_steps=40",
        *QUICK,
    )
    finetune = ["checkpoint.init_from=ckpt/pre/step_200", "checkpoint.path=ckpt/ft", "training.steps=150", *QUICK]
    out = _on_ranks(2, "train.py", "mnist_finetune", tmp_path, *finetune)
    assert "kept the fresh init of ['digit_classifier.bias', 'digit_classifier.weight']" in out
    again = _on_ranks(2, "train.py", "mnist_finetune", tmp_path, *finetune)
    assert "resumed from ckpt/ft/step_150" in again and "nothing left to do" in again

    out = _on_ranks(
        3,
        "predict.py",
        "mnist_predict",
        tmp_path,
        "checkpoint.init_from=ckpt/ft/step_150",
        "predict.output=predictions.csv",
        "predict.micro_batch_size=64",
    )
    with open(tmp_path / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["idx"]) for r in rows] == list(range(1000))  # exactly one row per test sample, in file order
    from recipes.mnist.data import read_mnist_file

    _, labels = read_mnist_file(str(REPO / "data" / "mnist_5k"), False, False)
    assert [int(r["label"]) for r in rows] == labels.tolist()
    logits = torch.tensor([[float(r[f"logits_{k}"]) for k in range(10)] for r in rows])
    assert [int(r["prediction"]) for r in rows] == logits.argmax(dim=1).tolist()
    accuracy = sum(r["prediction"] == r["label"] for r in rows) / len(rows)
    assert accuracy > 0.5, accuracy  # 10 classes: chance is 0.1
    printed = float(re.search(r"wrote 1000 rows to \S+ \| accuracy (\S+)", out).group(1))
    assert abs(printed - accuracy) < 1e-4
    assert json.loads((tmp_path / "prediction_metrics.json").read_text()) == {"rows": 1000, "accuracy": accuracy}


def test_predict_refuses_without_weights(tmp_path):
    proc = run_python(
        REPO / "predict.py",
        "--config-name",
        "mnist_predict",
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "predict.py needs checkpoint.init_from" in proc.stdout + proc.stderr
