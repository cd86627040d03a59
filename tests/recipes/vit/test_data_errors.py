"""Image and MNIST data that cannot be used: every refusal is a DataError (MissingDataError when the file is
not there) naming the file and the setting that gave it (`data.root=...`, `predict.folder=...`, `--root` of
scripts/shard_images.py), also when a loader worker finds it; train.py and predict.py show it as one line and
exit with code 2, scripts/shard_images.py prints one `error: ...` line and exits with 2."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.config.errors import ConfigError, DataError, MissingDataError, message_of
from recipes.vit.config import ImageDataConfig, ImageFormat, ViTModelConfig
from recipes.vit.data import ImageSamples, Transform, image_classes, prediction_samples, split_samples
from recipes.vit.shards import write_shards
from tests.support.helpers import REPO, run_python, validated_config

DIGITS = REPO / "data" / "digits"


def _digit_subset(per_class: int) -> dict[str, list[tuple[str, int]]]:
    """`per_class` of the shipped digits of each class, per split: (file, label)."""
    return {
        split: [(str(p), c) for c in range(10) for p in sorted((DIGITS / split / str(c)).glob("*.png"))[:per_class]]
        for split in ("train", "val")
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """20 training and 10 validation digits in tar shards of 8 samples."""
    out = tmp_path_factory.mktemp("shards") / "digits"
    write_shards(out, [str(c) for c in range(10)], _digit_subset(2), max_samples=8)
    return out


def _copy(shards: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(shards, to)
    return to


def damage_index(root: Path) -> Path:
    index = json.loads((root / "index.json").read_text())
    index["version"] = 7
    (root / "index.json").write_text(json.dumps(index))
    return root / "index.json"


def damage_members(root: Path, split: str = "train") -> None:
    """Every member header of the split's shards made wrong (its checksum field), the index left as it was."""
    table = np.load(root / f"{split}.npy")
    for shard, header, *_ in table.tolist():
        with open(root / f"{split}-{shard:06d}.tar", "r+b") as f:
            f.seek(header + 148)
            f.write(b"\x00\xff")


def _shard_data(root: Path) -> ImageDataConfig:
    return ImageDataConfig(root=str(root), format=ImageFormat.shards)


# --- each refusal: its type and its message -------------------------------------------------------------


def test_a_damaged_shard_index_names_the_file_and_data_root(shards, tmp_path):
    root = _copy(shards, tmp_path / "s")
    index = damage_index(root)
    with pytest.raises(DataError, match=rf"^data.root={root}: {index}: version=7: this code reads version 1$"):
        image_classes(_shard_data(root))
    index.unlink()
    with pytest.raises(MissingDataError, match=rf"^data.root={root}: {index}: no such file"):
        image_classes(_shard_data(root))


def test_a_damaged_shard_table_and_a_foreign_class_list_are_data_errors(shards, tmp_path):
    root = _copy(shards, tmp_path / "s")
    data = _shard_data(root)
    transform = Transform(data, 28, train=True)
    with pytest.raises(DataError, match=rf"^data.root={root}: the shards' classes differ"):
        split_samples(ImageSamples, data, "train", ["a", "b"], transform, 0)
    np.save(root / "train.npy", np.zeros((3, 5), dtype=np.int64))
    with pytest.raises(DataError, match=rf"^data.root={root}: {root / 'train.npy'}: 3 rows, but"):
        split_samples(ImageSamples, data, "train", [str(c) for c in range(10)], transform, 0)


def test_a_shard_damaged_inside_names_the_member_in_a_loader_worker_in_one_line(shards, tmp_path):
    root = _copy(shards, tmp_path / "s")
    damage_members(root)
    data = _shard_data(root)
    samples = split_samples(ImageSamples, data, "train", [str(c) for c in range(10)], Transform(data, 28, True), 0)
    member = rf"{root}/train-000000.tar:00000003: no tar header where the index points \(bad checksum\)"
    with pytest.raises(DataError, match=rf"^data.root={root}: {member}"):
        samples[3]
    loader = torch.utils.data.DataLoader(samples, batch_size=4, num_workers=1)
    with pytest.raises(DataError) as caught:
        next(iter(loader))
    message = message_of(caught.value)
    assert "\n" not in message and message.startswith(f"data.root={root}: {root}/train-000000.tar:0000000")
    assert message.endswith("(in a data loader worker)")


def test_an_image_that_cannot_be_decoded_names_the_file_and_the_setting(tmp_path):
    folder = tmp_path / "incoming"
    folder.mkdir()
    Image.new("RGB", (40, 40)).save(folder / "cut.png")
    (folder / "cut.png").write_bytes((folder / "cut.png").read_bytes()[:60])  # header whole, pixels cut
    Image.new("RGB", (40, 40)).save(folder / "gone.png")
    data = ImageDataConfig(root=str(DIGITS), verify_images=False)
    samples = prediction_samples(data, ViTModelConfig(img_size=28, patch_size=7, num_classes=10), 0, None, str(folder))
    with pytest.raises(DataError, match=rf"^predict.folder={folder}: cannot decode the image {folder}/cut.png"):
        samples[0]
    (folder / "gone.png").unlink()  # since the folder was listed
    with pytest.raises(DataError, match=rf"^predict.folder={folder}: cannot read the image {folder}/gone.png"):
        samples[1]


@pytest.mark.parametrize("kind", ["missing", "empty", pytest.param("unreadable", marks=pytest.mark.slow)])
def test_a_predict_folder_that_cannot_be_used_is_named(tmp_path, kind):
    folder = tmp_path / "incoming"
    if kind != "missing":
        folder.mkdir()
        (folder / "README.txt").write_text("no images")
    if kind == "unreadable":
        (folder / "empty.png").write_bytes(b"")
    error, message = {
        "missing": (MissingDataError, f"{folder}: no such folder"),
        "empty": (DataError, f"{folder} holds no image files"),
        "unreadable": (DataError, f"{folder}: no readable images"),
    }[kind]
    with pytest.raises(error, match=rf"^predict.folder={folder}: {message}"):
        prediction_samples(ImageDataConfig(root=str(DIGITS)), ViTModelConfig(img_size=28), 0, None, str(folder))


def test_an_image_folder_of_the_wrong_layout_is_named(tmp_path):
    (tmp_path / "flat" / "train").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "train" / "0.png")  # no class folders
    with pytest.raises(
        DataError,
        match=rf"^data.root={tmp_path / 'flat'}: {tmp_path / 'flat' / 'train'} has no class "
        "folders with images",
    ):
        image_classes(ImageDataConfig(root=str(tmp_path / "flat")))
    with pytest.raises(MissingDataError, match=rf"^data.root={tmp_path}: {tmp_path / 'train'}: no such folder"):
        image_classes(ImageDataConfig(root=str(tmp_path)))
    (tmp_path / "tiny" / "train" / "n01" / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "tiny" / "train" / "n01" / "images" / "0.png")
    (tmp_path / "tiny" / "wnids.txt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(
        DataError,
        match=rf"^data.root={tmp_path / 'tiny'}: {tmp_path / 'tiny' / 'wnids.txt'}: cannot "
        "be read as a text file",
    ):
        image_classes(ImageDataConfig(root=str(tmp_path / "tiny"), format=ImageFormat.tiny_imagenet))


def test_a_missing_data_root_and_an_unknown_format_are_named(tmp_path):
    with pytest.raises(
        MissingDataError,
        match=rf"^data.root={tmp_path / 'gone'}: no such folder, and no "
        rf"{tmp_path / 'gone'}.tar.gz",
    ):
        image_classes(ImageDataConfig(root=str(tmp_path / "gone")))
    with pytest.raises(MissingDataError, match="^data.root is not set"):
        image_classes(ImageDataConfig(root=None))


def _mnist_root(tmp_path: Path, images: bytes, labels: bytes = b"\x01\x02") -> Path:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(images)
    header = b"\x00\x00\x08\x01" + len(labels).to_bytes(4, "big")
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(header + labels))
    return tmp_path


def _mnist_images(n: int, size: int = 2) -> bytes:
    return b"\x00\x00\x08\x03" + n.to_bytes(4, "big") + size.to_bytes(4, "big") * 2 + b"\x07" * (n * size * size)


@pytest.mark.parametrize(
    "images,message",
    [
        (b"", r"not an IDX file of unsigned bytes \(magic number missing\)"),
        (b"\x00\x00\x08\x03\x00\x00", "cut short inside its header"),
        (b"\x00\x00\x08\x03" + b"\xff" * 12 + b"\x00" * 100, r"header says \(4294967295, .* more than the 1073741824"),
        (_mnist_images(1000)[:-1], r"3999 bytes of data, but the header says \(1000, 2, 2\)"),
        (_mnist_images(0), r"the header says \(0, 2, 2\): no data"),
        (
            b"\x00\x00\x08\x03"
            + (3).to_bytes(4, "big")
            + (2).to_bytes(4, "big")
            + (3).to_bytes(4, "big")
            + b"\x00" * 18,
            r"\(3, 2, 3\) images do not match \(2,\) labels",
        ),
    ],
    ids=["empty", "header cut", "claims 2**96 bytes", "cut short", "no images", "labels of other images"],
)
def test_mnist_files_that_cannot_be_used_name_the_file_and_data_root(tmp_path, images, message):
    from recipes.mnist.data import read_mnist_file

    root = _mnist_root(tmp_path, images)
    with pytest.raises(DataError, match=rf"^data.root={root}: {root / 'MNIST' / 'raw'}.*{message}"):
        read_mnist_file.__wrapped__(str(root), True, False)


def test_mnist_labels_past_the_classes_name_the_labels_file(tmp_path):
    from recipes.mnist.config import MNISTDataConfig
    from recipes.mnist.data import build_mnist_split, read_mnist_file

    root = _mnist_root(tmp_path, _mnist_images(3), labels=b"\x09\xc8\xc8")  # 200: not a digit
    labels = root / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz"
    with pytest.raises(
        DataError, match=rf"^data.root={root}: {labels}: label 200 at row 1 \(2 rows in all\) is outside 0..9"
    ):
        read_mnist_file.__wrapped__(str(root), True, False)
    with pytest.raises(DataError, match=r"label 9 at row 0 \(1 rows in all\) is outside 0..4 \(model.num_classes=5\)"):
        build_mnist_split(
            MNISTDataConfig(root=str(_mnist_root(tmp_path / "b", _mnist_images(1), b"\x09"))), "val", 2, 5
        )


def test_an_mnist_gzip_claiming_gigabytes_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from recipes.mnist import data

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    bomb.write_bytes(
        gzip.compress(
            b"\x00\x00\x08\x03" + (2_739_145).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + bytes(1 << 20)
        )
    )
    monkeypatch.setattr(data, "_read_up_to", None)  # never reached
    with pytest.raises(DataError, match=rf"^{bomb}: the header says \(2739145, 28, 28\), 2147489680 bytes, more than"):
        data.read_idx(bomb)


def test_a_damaged_mnist_gzip_names_the_file(tmp_path):
    from recipes.mnist.data import read_idx

    damaged = tmp_path / "t10k-labels-idx1-ubyte.gz"
    damaged.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\x01" * 5)[:-12])
    with pytest.raises(DataError, match=rf"^{damaged}: cannot be read \(EOFError"):
        read_idx(damaged)


def test_shard_images_names_the_root_in_one_error_line(tmp_path, monkeypatch, capsys):
    from tests.unit.scripts.test_data_scripts import run_script

    (tmp_path / "flat" / "train").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "train" / "0.png")
    with pytest.raises(SystemExit, match="^2$"):
        run_script("shard_images", monkeypatch, "--root", str(tmp_path / "flat"), "--out", str(tmp_path / "out"))
    assert capsys.readouterr().err == (
        f"error: --root {tmp_path / 'flat'}: {tmp_path / 'flat' / 'train'} has no class "
        "folders with images (expected <split>/<class>/<image>, image files ending in "
        ".jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp)\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_split_predict_py_does_not_know_is_a_config_error_for_mnist():
    from recipes.mnist.config import MNISTDataConfig
    from recipes.mnist.data import build_mnist_split

    with pytest.raises(ConfigError, match="^predict.split=holdout: expected one of train, val, test"):
        build_mnist_split(MNISTDataConfig(root="unused"), "holdout", 28)


# --- the entry points: one line, exit code 2 --------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_weights(tmp_path_factory) -> Path:
    """A vit_sanity model's freshly initialised weights, as a .safetensors file (predict.py's init_from)."""
    from safetensors.torch import save_file

    from core.layers.namespace import get_layers
    from recipes.vit.recipe import ViTRecipe

    path = tmp_path_factory.mktemp("weights") / "fresh.safetensors"
    cfg = validated_config("vit_sanity", [f"checkpoint.path={path.parent}/ckpt"])
    model = ViTRecipe(cfg).build_model(get_layers("torch"), torch.device("cpu"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _one_error_line(proc, expected: str) -> None:
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert len(errors) == 1 and expected in errors[0], output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["damaged index", "damaged in a worker", "bad predict.folder"])
def test_the_entry_points_show_a_data_refusal_as_one_line_and_exit_2(shards, fresh_weights, tmp_path, case):
    root = _copy(shards, tmp_path / "s")
    common = ["--config-name", "vit_sanity", f"hydra.run.dir={tmp_path}/run", "logger.progress_bar=never"]
    if case == "bad predict.folder":
        folder = tmp_path / "incoming"
        folder.mkdir()
        (folder / "notes.txt").write_text("no images here")
        proc = run_python(
            "predict.py",
            *common,
            f"checkpoint.init_from={fresh_weights}",
            f"predict.folder={folder}",
            "data.num_workers=0",
            timeout=300,
        )
        return _one_error_line(proc, f"data error: predict.folder={folder}: {folder} holds no image files")
    if case == "damaged index":
        expected = f"data error: data.root={root}: {damage_index(root)}: version=7"
    else:
        damage_members(root)
        expected = f"data error: data.root={root}: {root}/train-0000"
    proc = run_python(
        "train.py",
        *common,
        "data.format=shards",
        f"data.root={root}",
        "data.num_workers=1",
        "training.steps=2",
        f"checkpoint.path={tmp_path}/ckpt",
        timeout=300,
    )
    _one_error_line(proc, expected)
    if case == "damaged in a worker":
        assert "no tar header where the index points" in proc.stdout + proc.stderr
        assert (proc.stdout + proc.stderr).rstrip().endswith("(in a data loader worker)")
