"""Image folders as users bring them: a Tiny-ImageNet subset with the full index files, an ImageFolder with
corrupt, empty, hidden and stray files; the classes counted from the data; and both train and learn."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image

from core.config.errors import ConfigError, DataError
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, image_classes, prediction_samples, split_files
from recipes.vit.shards import write_shards
from tests.support.helpers import read_records, train_run, validated_config, within

COLOURS = [(220, 40, 40), (40, 200, 60), (50, 70, 230), (230, 210, 40), (160, 50, 200)]


def _image(rng: np.random.Generator, label: int) -> Image.Image:
    """A 28 px image that a tiny ViT tells apart by class: the class's colour plus noise."""
    pixels = np.array(COLOURS[label], dtype=np.float32) + rng.normal(0, 30, (28, 28, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def make_tiny_imagenet_subset(root, per_class: int = 12, val_per_class: int = 6):
    """Like BioNeMo's 5-class subset: 5 classes' train folders and their validation images, but the full
    200-line wnids.txt (not sorted) and annotations for classes and files that are not there."""
    rng = np.random.default_rng(0)
    kept = ["n09999999", "n01443537", "n05555555", "n03444034", "n02000001"]  # not in sorted order
    everything = [f"n0{i:07d}" for i in range(195)] + kept
    rng.shuffle(everything)
    (root / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("\n".join(everything) + "\n")
    (root / "words.txt").write_text("n01443537\tgoldfish\n")
    for label, wnid in enumerate(kept):
        images = root / "train" / wnid / "images"
        images.mkdir(parents=True)
        for i in range(per_class):
            _image(rng, label).save(images / f"{wnid}_{i}.JPEG")
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("box lines\n")
    (root / "train" / "n00000007" / "images").mkdir(parents=True)  # an empty class folder
    (root / "train" / ".DS_Store").write_text("x")
    (root / "val" / "images").mkdir(parents=True)
    lines, n = [], 0
    for label, wnid in enumerate(kept):
        for _ in range(val_per_class):
            _image(rng, label).save(root / "val" / "images" / f"val_{n}.JPEG")
            lines.append(f"val_{n}.JPEG\t{wnid}\t0\t0\t27\t27")
            n += 1
    lines += [f"val_{n + i}.JPEG\tn0{i:07d}\t0\t0\t27\t27" for i in range(40)]  # classes not shipped
    lines += [f"val_missing_{i}.JPEG\t{kept[0]}\t0\t0\t27\t27" for i in range(3)]  # files not shipped
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root, sorted(kept, key=everything.index)


def make_quirky_imagefolder(root, per_class: int = 12, val_per_class: int = 6):
    """Two splits of 3 classes, plus a corrupt JPEG, an empty PNG, a text file, a hidden folder, a nested
    subfolder, and an empty class folder."""
    rng = np.random.default_rng(1)
    classes = ["cat", "dog", "owl"]
    for split, n in (("train", per_class), ("val", val_per_class)):
        for label, name in enumerate(classes):
            folder = root / split / name
            (folder / "more").mkdir(parents=True)
            for i in range(n):
                _image(rng, label).save(folder / ("more" if i % 4 == 0 else "") / f"{i}.png")
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "train" / "dog" / "empty.png").write_bytes(b"")
    (root / "train" / "dog" / "notes.txt").write_text("labelled by hand\n")
    (root / "train" / ".ipynb_checkpoints").mkdir()
    _image(rng, 0).save(root / "train" / ".ipynb_checkpoints" / "x.png")
    (root / "train" / "owl" / ".hidden.png").write_bytes(b"junk")
    (root / "train" / "zebra").mkdir()  # no images: not a class
    return root, classes


def test_a_tiny_imagenet_subset_with_the_full_index_files(tmp_path, caplog):
    root, kept = make_tiny_imagenet_subset(tmp_path / "tiny5")
    data = ImageDataConfig(format="tiny_imagenet", root=str(root))
    assert image_classes(data) == kept  # wnids.txt order, the 5 with training images only
    with caplog.at_level(logging.INFO):
        val = split_files(data, "val", kept)
    assert len(val) == 30 and {label for _, label in val} == set(range(5))
    assert "left out 40 lines of classes without training images, 3 of files that are missing" in caplog.text
    assert len(split_files(data, "train", kept)) == 60


def test_a_tiny_imagenet_split_without_usable_lines_is_a_clear_error(tmp_path):
    root, kept = make_tiny_imagenet_subset(tmp_path / "tiny5", per_class=2, val_per_class=1)
    (root / "val" / "val_annotations.txt").write_text("val_x.JPEG\tn00000001\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="none of its lines names an existing file of a training class"):
        split_files(ImageDataConfig(format="tiny_imagenet", root=str(root)), "val", kept)


@pytest.mark.parametrize(
    "line,problem",
    [
        ("{outside}\tn01", r"'/.*/outside.png' is not the name of an image file in .*/val/images \(a plain name"),
        ("../../outside.png\tn02", r"'../../outside.png' is not the name of an image file"),
        ("images/val_0.JPEG\tn01", r"'images/val_0.JPEG' is not the name of an image file"),
        ("secret\tn01", r"'secret' is not the name of an image file"),
        ("val_0.JPEG\tn02", r"val_0.JPEG is annotated again \(first on line 1\)"),
    ],
    ids=["absolute", "up", "a path", "no image extension", "twice"],
)
def test_tiny_imagenet_annotations_name_images_of_val_images_once(tmp_path, line, problem):
    """Annotations naming files elsewhere would train on them (and scripts/shard_images.py copy them)."""
    from recipes.vit.folders import tiny_imagenet_files

    (tmp_path / "val" / "images").mkdir(parents=True)
    for name in ("val_0.JPEG", "../../outside.png", "images/val_0.JPEG", "secret"):
        (tmp_path / "val" / "images" / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "val" / "images" / name, format="PNG")
    annotations = tmp_path / "val" / "val_annotations.txt"
    annotations.write_text("val_0.JPEG\tn01\t0 0 1 1\n\n" + line.format(outside=tmp_path / "outside.png") + "\n")
    with pytest.raises(DataError, match=rf"^{annotations}:3: {problem}"):
        tiny_imagenet_files(tmp_path, "val", ["n01", "n02"])


@pytest.mark.parametrize("which", ["wnids.txt", "val/val_annotations.txt"])
@pytest.mark.parametrize(
    "content,problem",
    [
        (b"n01\n" + b"\0" * 5000, r":2: a line longer than 4096 characters"),
        (None, r": larger than 67108864 bytes"),
        (b"n01\n\xff\n", r": cannot be read as a text file \(UnicodeDecodeError"),
    ],
    ids=["an endless line", "sparse GiB", "not UTF-8"],
)
def test_tiny_imagenet_index_files_are_read_with_a_bound(tmp_path, which, content, problem):
    """A sparse file or a bomb (a few hundred bytes of .tar.gz) is refused before it is read whole."""
    from recipes.vit.folders import tiny_imagenet_classes, tiny_imagenet_files

    (tmp_path / "train" / "n01" / "images").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "train" / "n01" / "images" / "0.png")
    (tmp_path / "val" / "images").mkdir(parents=True)
    index = tmp_path / which
    with open(index, "wb") as f:
        if content is None:
            f.truncate(1 << 30)  # sparse: nothing on disk
        else:
            f.write(content)
    with pytest.raises(DataError, match=rf"^{index}{problem}"):
        tiny_imagenet_files(tmp_path, "val", tiny_imagenet_classes(tmp_path))


@pytest.mark.parametrize("kind", ["a dangling link", "a FIFO"])
def test_a_wnids_txt_that_cannot_be_read_is_named_not_passed_over(tmp_path, kind):
    """Passed over, it made the classes sorted by name: other labels than the file's, without a word."""
    from recipes.vit.folders import tiny_imagenet_classes

    for w in ("n09", "n01"):
        (tmp_path / "train" / w / "images").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "train" / w / "images" / "0.png")
    if kind == "a FIFO":
        os.mkfifo(tmp_path / "wnids.txt")
    else:
        (tmp_path / "wnids.txt").symlink_to(tmp_path / "moved.txt")
    problem = "NotThisKindOfFile: it is a FIFO" if kind == "a FIFO" else "FileNotFoundError"
    with pytest.raises(DataError, match=rf"^{tmp_path / 'wnids.txt'}: cannot be read as a text file \({problem}"):
        tiny_imagenet_classes(tmp_path)


def test_an_imagefolder_with_bad_stray_and_hidden_files(tmp_path, caplog):
    root, classes = make_quirky_imagefolder(tmp_path / "pets")
    data = ImageDataConfig(format="imagefolder", root=str(root))
    with caplog.at_level(logging.INFO):
        assert image_classes(data) == classes  # not .ipynb_checkpoints, not the empty zebra folder
        train = split_files(data, "train", classes)
    assert len(train) == 36 and all("broken" not in p and "empty" not in p and "hidden" not in p for p, _ in train)
    assert "left out 2 of 38 image files that cannot be read" in caplog.text
    assert "left out 1 class folders without images: zebra" in caplog.text
    assert f"{root / 'train'}: left out 1 files without an image extension (.jpg, " in caplog.text
    assert f"): {root / 'train' / 'dog' / 'notes.txt'}\n" in caplog.text + "\n"
    everything = split_files(
        ImageDataConfig(format="imagefolder", root=str(root), verify_images=False), "train", classes
    )
    assert len(everything) == 38  # unchecked: the bad files stay (and would stop training, naming the file)


@pytest.mark.parametrize("tree", ["tiny_imagenet", "imagefolder"])
def test_quirky_trees_train_and_learn_with_classes_from_the_data(tree, tmp_path, caplog):
    if tree == "tiny_imagenet":
        root, classes = make_tiny_imagenet_subset(tmp_path / "data")
    else:
        root, classes = make_quirky_imagefolder(tmp_path / "data")
    overrides = [
        f"data={tree}",
        f"data.root={root}",
        "training.steps=30",
        "training.val_every_n_steps=30",
        "training.micro_batch_size=12",
        "training.global_batch_size=12",
        "training.log_every_n_steps=10",
        "data.num_workers=0",
        "logger.progress_bar=never",
        "scheduler.warmup_steps=3",
        f"checkpoint.path={tmp_path}/ckpt",
    ]
    cfg = validated_config("vit_sanity", overrides)
    assert cfg.data.num_classes is None  # taken from the data at start
    with caplog.at_level(logging.INFO):
        train_run(cfg, tmp_path / "run")
    saved = (tmp_path / "run" / "resolved_config.yaml").read_text()
    assert f"num_classes: {len(classes)}" in saved and "num_classes: null" not in saved
    (val,) = [r for r in read_records(tmp_path / "run") if r.get("split") == "val"]
    assert val["top1"] >= 0.9, val  # chance: 1 / classes
    with pytest.raises(ConfigError, match=f"data.num_classes=7, but .* holds {len(classes)} classes"):
        train_run(validated_config("vit_sanity", [*overrides, "data.num_classes=7"]), tmp_path / "run2")


def test_a_training_class_without_readable_images_is_a_clear_error(tmp_path):
    root, classes = make_quirky_imagefolder(tmp_path / "pets", per_class=2, val_per_class=1)
    for image in (root / "train" / "owl").rglob("*.png"):
        image.write_bytes(b"")  # every owl truncated to nothing
    with pytest.raises(ValueError, match="1 classes have no readable images: owl"):
        split_files(ImageDataConfig(format="imagefolder", root=str(root)), "train", classes)


def test_predict_split_names_follow_the_data_config(tmp_path):
    """predict.split=val reads the folder data.val_split names (here `validation`)."""
    root, classes = make_quirky_imagefolder(tmp_path / "pets", per_class=2, val_per_class=2)
    (root / "val").rename(root / "validation")
    data = ImageDataConfig(format="imagefolder", root=str(root), val_split="validation")
    samples = prediction_samples(data, ViTModelConfig(img_size=32, num_classes=len(classes)), 0, "val", None, classes)
    assert len(samples) == len(split_files(data, "validation", classes)) > 0


@pytest.mark.parametrize("kind", ["a FIFO", "a link to /dev/zero"])
def test_a_name_like_an_image_that_is_no_file_is_left_out_or_named_never_waited_on(tmp_path, caplog, kind):
    """A FIFO would block its reader until a writer comes; /dev/zero would be read until memory runs out."""
    root, classes = make_quirky_imagefolder(tmp_path / "pets", per_class=2, val_per_class=1)
    odd = root / "train" / classes[0] / "odd.jpg"
    os.mkfifo(odd) if kind == "a FIFO" else os.symlink("/dev/zero", odd)
    says = "it is a FIFO, not a regular file" if kind == "a FIFO" else "it is a character device, not a regular file"
    with within(10), caplog.at_level(logging.WARNING):
        listed = split_files(ImageDataConfig(format="imagefolder", root=str(root)), "train", classes)
    assert str(odd) not in [path for path, _ in listed] and f"{odd} (NotThisKindOfFile: {says})" in caplog.text
    data = ImageDataConfig(format="imagefolder", root=str(root), num_classes=len(classes), verify_images=False)
    train = build_image_datasets(data, ViTModelConfig(img_size=16, patch_size=4, num_classes=len(classes)), 0)[0]
    position = [path for path, _ in train.files].index(str(odd))
    with within(10), pytest.raises(DataError, match=rf"cannot read the image {odd} \({says}\); remove or replace"):
        train[position]
    with within(10), pytest.raises(DataError, match=rf"{odd}: cannot be written into a shard \(.*{says}\)"):
        write_shards(tmp_path / "shards", classes, {"train": [(str(odd), 0)]})


def test_a_16_bit_grayscale_image_trains_as_its_8_bit_self_not_white(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (48, 1))
    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (32, 32), (10, 200, 30)).save(tmp_path / split / name / "ok.png")
        Image.fromarray(ramp).save(tmp_path / split / "a" / "ramp16.png")
        Image.fromarray((ramp >> 8).astype(np.uint8)).save(tmp_path / split / "a" / "ramp8.png")
    assert Image.open(tmp_path / "val" / "a" / "ramp16.png").mode == "I;16"
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path), num_classes=2)
    train, val = build_image_datasets(data, ViTModelConfig(img_size=16, patch_size=4, num_classes=2), seed=0)
    names = [os.path.basename(path) for path, _ in val.files]
    sixteen, eight = val[names.index("ramp16.png")]["image"], val[names.index("ramp8.png")]["image"]
    assert torch.equal(sixteen, eight) and sixteen.float().std() > 30
    names = [os.path.basename(path) for path, _ in train.files]
    assert (train[names.index("ramp16.png")]["image"] == 255).float().mean() < 0.5  # a random crop of the ramp


def test_a_val_split_the_data_lacks_is_a_warning_naming_the_folders_there(tmp_path, caplog):
    """data.val_split=valid (a typo of val) trained without validation, said only in the info log."""
    root, classes = make_quirky_imagefolder(tmp_path / "pets", per_class=2, val_per_class=1)
    data = ImageDataConfig(format="imagefolder", root=str(root), val_split="valid", num_workers=0)
    with caplog.at_level(logging.WARNING):
        train, val = build_image_datasets(data, ViTModelConfig(img_size=32, num_classes=len(classes)), 0)
    assert val is None and len(train) > 0
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.val_split")] == [
        f"data.val_split=valid: data.root={root} has no such split (its folders besides train: val); the run trains "
        "without validation"
    ]
