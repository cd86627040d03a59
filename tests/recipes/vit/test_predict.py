"""predict.py with the ViT on 2 processes: a labelled split (accuracy from the rows equals the reported
one) and a folder of unlabeled images (rows in sorted path order)."""

from __future__ import annotations

import csv
import json
import logging
import os

import numpy as np
import pytest
import torch

from core.config.errors import ConfigError
from tests.recipes.vit.test_image_folders import _image, make_quirky_imagefolder
from tests.support.helpers import REPO, run_python_ranks, train_run, validated_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vit")
    root, classes = make_quirky_imagefolder(tmp / "pets")
    overrides = [
        "data=imagefolder",
        f"data.root={root}",
        "training.steps=30",
        "training.val_every_n_steps=0",
        "training.micro_batch_size=12",
        "training.global_batch_size=12",
        "data.num_workers=0",
        "logger.progress_bar=never",
        "scheduler.warmup_steps=3",
        f"checkpoint.path={tmp}/ckpt",
    ]
    train_run(validated_config("vit_sanity", overrides), tmp / "run")
    return tmp, root, classes


def _predict(tmp, root, out, *overrides):
    proc = run_python_ranks(
        2,
        REPO / "predict.py",
        "--config-name",
        "vit_predict",
        "data=imagefolder",
        f"data.root={root}",  # the model: its config.yaml
        "precision=fp32",
        "data.num_workers=0",
        f"checkpoint.init_from={tmp}/ckpt/step_30",
        "predict.micro_batch_size=4",
        f"predict.output={out}/predictions.csv",
        f"hydra.run.dir={out}/run",
        *overrides,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "predictions.csv") as f:
        return list(csv.DictReader(f)), json.loads((out / "prediction_metrics.json").read_text())


@pytest.mark.slow
def test_predict_a_labelled_split(trained, tmp_path):
    tmp, root, classes = trained
    rows, metrics = _predict(tmp, root, tmp_path)
    assert [int(r["idx"]) for r in rows] == list(range(18))  # every val image once, in order
    files = [str(p.relative_to(root)) for c in classes for p in sorted((root / "val" / c).rglob("*.png"))]
    assert [r["file"] for r in rows] == files and "val/cat/more/0.png" in files  # by class, then path
    assert [int(r["label"]) for r in rows] == [classes.index(f.split("/")[1]) for f in files]
    assert all(r["top_name_0"] == classes[int(r["top_0"])] for r in rows)
    assert all(float(r["prob_0"]) >= float(r["prob_1"]) >= float(r["prob_2"]) for r in rows)
    top1 = sum(r["top_0"] == r["label"] for r in rows) / len(rows)
    assert metrics == {"rows": 18, "images": 18, "labelled": 18, "top1": top1, "top5": 1.0}  # 3 classes: all in top 5
    assert top1 >= 0.9


@pytest.mark.slow
def test_predict_a_folder_of_unlabeled_images(trained, tmp_path):
    tmp, root, classes = trained
    rng = np.random.default_rng(5)
    folder = tmp_path / "incoming"
    (folder / "b").mkdir(parents=True)
    names = ["z.png", "a.png", "b/c.png", "b/a.png", "m.jpg"]
    for i, name in enumerate(names):
        _image(rng, i % 3).convert("RGB").save(folder / name)
    (folder / "README.txt").write_text("not an image")
    (folder / ".DS_Store").write_bytes(b"\x00")
    rows, metrics = _predict(tmp, root, tmp_path, f"predict.folder={folder}")
    assert [r["file"] for r in rows] == sorted(names)
    assert all(r["label"] == "-1" for r in rows)
    expected = {name: classes[i % 3] for i, name in enumerate(names)}
    assert sum(r["top_name_0"] == expected[r["file"]] for r in rows) >= 4
    assert metrics == {"rows": 5, "images": 5, "labelled": 0}


def test_predict_a_folder_with_only_the_checkpoint(trained, tmp_path, caplog):
    """No training data at hand: the model (its head size too) comes from the checkpoint's config.yaml, the
    rows carry class indices only (one process, in this one)."""
    import predict

    tmp, _, classes = trained
    folder = tmp_path / "incoming"
    folder.mkdir()
    for i in range(3):
        _image(np.random.default_rng(i), i).save(folder / f"{i}.png")
    cfg = validated_config(
        "vit_predict",
        [
            "data=imagefolder",
            f"data.root={tmp_path}/gone",
            "precision=fp32",
            "data.num_workers=0",
            f"predict.folder={folder}",
            f"checkpoint.path={tmp_path}/ckpt",
            "logger.progress_bar=never",
            f"checkpoint.init_from={tmp}/ckpt/step_30",
        ],
    )
    with caplog.at_level(logging.INFO):
        result = predict.predict(cfg, tmp_path / "run")
    assert f"model settings from {tmp}/ckpt/step_30/config.yaml" in caplog.text
    assert f"num_classes={len(classes)} as given" in caplog.text
    assert "class names unknown" in caplog.text
    with open(result.output) as f:
        rows = list(csv.DictReader(f))
    assert [r["file"] for r in rows] == ["0.png", "1.png", "2.png"] and "top_name_0" not in rows[0]
    assert [int(r["top_0"]) for r in rows] == [0, 1, 2]


def test_without_data_or_checkpoint_the_class_count_must_be_given(tmp_path):
    from recipes.vit.recipe import ViTRecipe

    cfg = validated_config(
        "vit_sanity", ["data=imagefolder", f"data.root={tmp_path}/gone", f"checkpoint.path={tmp_path}/ckpt"]
    )
    with pytest.raises(ConfigError, match="give data.num_classes"):
        ViTRecipe(cfg).resolve_config(cfg)


def test_a_recipe_keeps_nothing_between_calls(tmp_path):
    """The config is resolved before the recipe exists, and the recipe's calls read what they need from the
    config and the data: after every entry point's calls its instance holds the config (and a cache derived from
    it) only, so two calls in any order give the same."""
    from recipes.vit.recipe import ViTRecipe

    root, _ = make_quirky_imagefolder(tmp_path / "pets")
    cfg = ViTRecipe.resolve_config(
        validated_config(
            "vit_sanity",
            ["data=imagefolder", f"data.root={root}", "data.num_workers=0", f"checkpoint.path={tmp_path}/ckpt"],
        )
    )
    recipe = ViTRecipe(cfg)
    first = recipe.split("val")
    (
        recipe.build_datasets(),
        recipe.unlabeled(str(root / "train")),
        recipe.to_device({"image": first[0]["image"][None], "label": torch.tensor([0])}, torch.device("cpu")),
    )
    assert set(vars(recipe)) <= {"cfg", "_device_transform"}, vars(recipe).keys()
    again = ViTRecipe(cfg).split("val")
    assert first.class_names == again.class_names and first.samples.files == again.samples.files


def test_a_file_name_that_is_not_utf8_is_written_as_its_bytes_and_a_failed_write_leaves_nothing(tmp_path):
    """os.listdir gives such a name with surrogate escapes; the CSV holds the name's own bytes, so the row leads back
    to the file. A write that fails leaves neither a CSV nor its temporary file."""
    from predict import write_csv

    odd = os.fsdecode(b"caf\xe9.png")
    assert write_csv(tmp_path / "p.csv", {"file": [odd, "ok.png"], "top1": torch.tensor([1.0, 2.0])}) == 2
    assert (tmp_path / "p.csv").read_bytes().splitlines() == [b"file,top1", b"caf\xe9.png,1", b"ok.png,2"]
    with open(tmp_path / "p.csv", newline="", encoding="utf-8", errors="surrogateescape") as f:
        assert os.fsencode(list(csv.reader(f))[1][0]) == b"caf\xe9.png"
    with pytest.raises(ValueError):
        write_csv(tmp_path / "q.csv", {"file": ["a.png"], "top1": [BadFloat(1.0)]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"]


class BadFloat(float):
    def __format__(self, spec):
        raise ValueError("cannot be written")


def test_a_link_planted_at_the_csvs_old_temporary_name_is_not_followed(tmp_path):
    from predict import write_csv

    victim = tmp_path / "notes.txt"
    victim.write_text("mine")
    (tmp_path / "p.csv.tmp").symlink_to(victim)
    write_csv(tmp_path / "p.csv", {"file": ["a.png"]})
    assert victim.read_text() == "mine" and not (tmp_path / "p.csv").is_symlink()
    assert (tmp_path / "p.csv").read_bytes() == b"file\r\na.png\r\n"


def test_a_predict_output_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """An existing folder, or a path under a file, failed with a traceback when writing, after every prediction."""
    from predict import prediction_output

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=rf"^predict.output={tmp_path} is a folder: give a file in it \(e\.g\. "):
        prediction_output(str(tmp_path), tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"^predict.output=.*/notes.txt/p.csv: {tmp_path}/notes.txt is a file, not"):
        prediction_output(str(tmp_path / "notes.txt" / "p.csv"), tmp_path / "run")
    assert prediction_output(str(tmp_path / "new folder" / "p.csv"), tmp_path) == tmp_path / "new folder" / "p.csv"
    assert prediction_output(None, tmp_path / "run") == tmp_path / "run" / "predictions.csv"
