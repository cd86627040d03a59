"""Tar shards (recipes/vit/shards.py, scripts/shard_images.py): written and read back with the folder's
samples, bit for bit; damaged or hostile shard folders stopped with a message naming the file; training on
shards equals training on the folder, and a run stopped mid-epoch on shards resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.config.errors import DataError
from core.data.datasets import EpochIndex
from recipes.vit.config import ImageDataConfig, ImageFormat
from recipes.vit.data import ImageSamples, Transform, split_samples
from recipes.vit.folders import imagefolder_classes, imagefolder_files
from recipes.vit.image_header import HEADER_PREFIXES, MOST_FILE_BYTES
from recipes.vit.shards import BLOCK, ShardEntry, ShardReader, ShardSplit, read_index, write_shards
from tests.support.checkpoint_harness import TINY, run_phases
from tests.support.helpers import REPO, run_workers

DIGITS = REPO / "data" / "digits"


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory) -> Path:
    """The shipped digits in shards of at most 500 samples (train: 1,438 in 3 shards; val: 359 in 1)."""
    out = tmp_path_factory.mktemp("shards") / "digits"
    classes = imagefolder_classes(DIGITS / "train")
    write_shards(out, classes, {s: imagefolder_files(DIGITS / s, classes) for s in ("train", "val")}, 500)
    return out


def _copy(shards: Path, tmp_path: Path) -> Path:
    shutil.copytree(shards, tmp_path / "copy")
    return tmp_path / "copy"


def test_shards_hold_the_folders_samples_bit_for_bit(digit_shards):
    classes, splits = read_index(digit_shards)
    assert classes == [str(d) for d in range(10)]
    assert {name: (len(s), [e.samples for e in s.shards]) for name, s in splits.items()} == {
        "train": (1438, [500, 500, 438]),
        "val": (359, [359]),
    }
    for split, train in (("train", True), ("val", False)):
        folder_data = ImageDataConfig(root=str(DIGITS), hflip=0.5)
        shard_data = ImageDataConfig(root=str(digit_shards), format=ImageFormat.shards, hflip=0.5)
        transform = Transform(folder_data, 28, train=train)
        from_folder = split_samples(ImageSamples, folder_data, split, classes, transform, 7)
        from_shards = split_samples(ImageSamples, shard_data, split, classes, transform, 7)
        assert len(from_folder) == len(from_shards)
        assert [label for _, label in from_folder.files] == splits[split].labels()
        n = len(from_folder)
        for index in (EpochIndex(0, 0), EpochIndex(3, n // 3), EpochIndex(1, n // 2), EpochIndex(2, n - 1)):
            a, b = from_folder[index], from_shards[index]  # the same crop and flip drawn from (seed, epoch, idx)
            assert a["label"] == b["label"] and torch.equal(a["image"], b["image"]), (split, index)


def test_resized_shards_are_jpegs_of_the_shorter_side(tmp_path):
    folder = tmp_path / "images" / "train"
    for name, size in (("a", (64, 48)), ("b", (30, 90)), ("c", (10, 12))):
        (folder / name).mkdir(parents=True)
        Image.new("RGB", size, (200, 30, 90)).save(folder / name / "x.png")
    split = write_shards(
        tmp_path / "out", ["a", "b", "c"], {"train": imagefolder_files(folder, ["a", "b", "c"])}, shorter_side=16
    )["train"]
    sizes = []
    for position in range(3):
        raw = ShardReader(split)(position)
        assert raw[:2] == b"\xff\xd8"  # JPEG
        with Image.open(__import__("io").BytesIO(raw)) as img:
            sizes.append(img.size)
    assert sizes == [(21, 16), (16, 48), (10, 12)]  # never enlarged
    one = {"train": [(str(folder / "a" / "x.png"), 0)]}
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        write_shards(tmp_path / "out", ["a"], one)
    with pytest.raises(ValueError, match="split 'val' has no images"):
        write_shards(tmp_path / "new", ["a"], {**one, "val": []})
    with pytest.raises(ValueError, match=r"split name '../x'"):
        write_shards(tmp_path / "new", ["a"], {**one, "../x": one["train"]})
    assert not (tmp_path / "new").exists()  # refused before anything was written
    (folder / "a" / "cut.jpg").write_bytes(Image.new("RGB", (40, 40)).tobytes()[:300])  # not an image
    with pytest.raises(ValueError, match=r"cut.jpg: cannot be written into a shard"):
        write_shards(
            tmp_path / "new", ["a"], {"train": [*one["train"], (str(folder / "a" / "cut.jpg"), 0)]}, shorter_side=16
        )
    assert list((tmp_path / "new").iterdir()) == []  # the shards written before the bad file are removed


def _edit_index(root: Path, edit) -> None:
    index = json.loads((root / "index.json").read_text())
    edit(index)
    (root / "index.json").write_text(json.dumps(index))


def _edit_table(root: Path, edit) -> None:
    table = np.load(root / "train.npy")
    edit(table)
    np.save(root / "train.npy", table)


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda r: _edit_index(r, lambda i: i["splits"]["train"]["shards"][0].update(name="../train-000000.tar")),
            "not a plain .tar/.npy name",
        ),
        (lambda r: _edit_index(r, lambda i: i["splits"]["train"].update(table="/etc/passwd")), "not a plain"),
        (lambda r: _edit_index(r, lambda i: i.update(version=2)), "version=2"),
        (lambda r: (r / "index.json").write_bytes(b"\x80\x04K\x01."), "not an index of this format"),
        (lambda r: (r / "train-000001.tar").unlink(), "listed in .*index.json but not there"),
        (
            lambda r: (r / "train-000001.tar").open("ab").write(b"x"),
            r"train-000001.tar: \d+ bytes, but .*index.json says",
        ),
        (lambda r: _edit_table(r, lambda t: t.__setitem__((5, 4), 10)), "row 5 .* does not point"),
        (lambda r: _edit_table(r, lambda t: t.__setitem__((7, 2), t[7, 2] + 1)), "row 7 .* does not point"),
        (lambda r: _edit_table(r, lambda t: t.__setitem__((1437, 3), 10**9)), "row 1437 .* does not point"),
        (lambda r: np.save(r / "train.npy", np.zeros((1438, 5))), "expected int64 rows"),
        (lambda r: np.save(r / "train.npy", np.zeros((10, 5), dtype=np.int64)), "10 rows, but"),
        (lambda r: (r / "train.npy").write_bytes(b""), "not a table of this format"),
        # Offsets near 2**63: their sum would wrap around and pass a plain "ends inside the shard" check.
        (
            lambda r: _edit_table(
                r, lambda t: t.__setitem__((5, slice(1, 4)), [2**63 - 2**31, 2**63 - 2**31 + 512, 2**31])
            ),
            "row 5 .* does not point",
        ),
        (lambda r: _edit_index(r, lambda i: i["splits"].__setitem__("val", i["splits"]["train"])), "named twice"),
        (lambda r: _edit_index(r, lambda i: i.update(version=True)), "version=True"),
        (
            lambda r: (r / "index.json").write_text('{"format": "vit-image-shards", "version": 1, "version": 1}'),
            "'version' is given twice",
        ),
        (lambda r: (r / "index.json").write_text("[" * 100_000 + "]" * 100_000), "not an index of this format"),
    ],
)
def test_a_damaged_or_hostile_index_is_refused_naming_the_file(digit_shards, tmp_path, damage, message):
    root = _copy(digit_shards, tmp_path)
    damage(root)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_index(root)


def test_a_read_checks_the_member_header_against_the_index(digit_shards, tmp_path):
    root = _copy(digit_shards, tmp_path)
    (root / "notes.txt").write_text("a stray file beside the shards")  # not listed: left alone
    # Row 5 pointed at row 6's member (a consistent but wrong row), and row 9's header damaged in the shard.
    _edit_table(root, lambda t: t.__setitem__(5, [t[6, 0], t[6, 1], t[6, 2], t[6, 3], t[5, 4]]))
    table = np.load(root / "train.npy")
    with (root / "train-000000.tar").open("r+b") as f:
        f.seek(int(table[9, 1]) + 100)
        f.write(b"\x00\xff")
    reader = ShardReader(read_index(root)[1]["train"])
    assert len(reader(4)) == table[4, 3]
    with pytest.raises(ValueError, match=r"train-000000.tar:00000005: the index points at member '00000006.png'"):
        reader(5)
    with pytest.raises(ValueError, match=r"train-000000.tar:00000009: no tar header where the index points"):
        reader(9)
    assert table[9, 1] % BLOCK == 0


def _one_member(root: Path, size: int) -> Path:
    """A consistent shard folder whose one image member is declared `size` bytes: a JPEG's first bytes, then a
    hole (sparse: a few KiB on disk)."""
    root.mkdir()
    info = tarfile.TarInfo("00000000.jpg")
    info.size = size
    with (root / "train-000000.tar").open("wb") as f:
        f.write(info.tobuf(tarfile.GNU_FORMAT) + b"\xff\xd8\xff\xe0")
        f.truncate(BLOCK + -(-size // BLOCK) * BLOCK + 2 * BLOCK)
    np.save(root / "train.npy", np.array([[0, 0, BLOCK, size, 0]], dtype=np.int64))
    shard = {"name": "train-000000.tar", "bytes": (root / "train-000000.tar").stat().st_size, "samples": 1}
    index = {"format": "vit-image-shards", "version": 1, "classes": ["a"]}
    (root / "index.json").write_text(
        json.dumps({**index, "splits": {"train": {"table": "train.npy", "shards": [shard]}}})
    )
    return root


def test_a_member_too_long_for_any_image_is_refused_before_it_is_read(tmp_path, monkeypatch):
    root = _one_member(tmp_path / "long", MOST_FILE_BYTES + 1)
    with pytest.raises(DataError, match=r"train.npy: row 0 gives the image train-000000.tar:00000000 268,435,457 by"):
        read_index(root)
    # A table changed after it was checked (a loader worker maps it again) is met by the read itself.
    shards = [ShardEntry(**s) for s in json.loads((root / "index.json").read_text())["splits"]["train"]["shards"]]
    table = np.load(root / "train.npy", mmap_mode="r")
    reader = ShardReader(ShardSplit(root, "train", shards, "train.npy", table))
    monkeypatch.setattr(os, "pread", lambda *args: pytest.fail("read"))
    with pytest.raises(DataError, match=r"train-000000.tar:00000000: the index gives this image 268,435,457 bytes"):
        reader(0)


def test_a_member_without_an_image_header_in_its_first_bytes_is_refused_before_it_is_parsed(tmp_path):
    reader = ShardReader(read_index(_one_member(tmp_path / "junk", 32 * 2**20))[1]["train"])
    with pytest.raises(
        DataError,
        match=rf"cannot decode the image {tmp_path}/junk/train-000000.tar:00000000 \(no image header with its size "
        f"in the first {HEADER_PREFIXES[-1]:,} bytes",
    ):
        reader(0)


SHARDED = [o for o in TINY if not o.startswith("data")] + [
    "data=digits",
    "data.format=shards",
    "data.num_workers=2",
    "model.img_size=28",
    "model.patch_size=7",
]


@pytest.mark.slow
def test_training_on_shards_equals_the_folder_and_resumes_exactly(digit_shards, tmp_path):
    """2 ranks, 8 steps of 16 digits: the folder and its shards give the same losses, bit for bit; on shards, a
    run stopped by SIGTERM after step 3 and started again continues them exactly; on one rank, the stopped run's
    checkpoint continues the same global order (equal to rounding: another reduction order)."""

    def phase(name: str, ckpt: str, shards: bool, **kw) -> dict:
        source = (
            SHARDED + [f"data.root={digit_shards}"] if shards else [o for o in SHARDED if o != "data.format=shards"]
        )
        return {"overrides": source + [f"checkpoint.path={tmp_path}/{ckpt}"], "run_dir": f"{tmp_path}/{name}", **kw}

    ranks = run_workers(
        2,
        run_phases,
        [
            phase("folder", "c_folder", False),
            phase("shards", "c_shards", True),
            phase("stopped", "c_job", True, signal_at=3),
            phase("resumed", "c_job", True),
        ],
    )
    folder, shards, stopped, resumed = ranks[0]
    assert sorted(folder["losses"]) == list(range(1, 9)) and shards["losses"] == folder["losses"]
    assert [r[1]["idx"] for r in ranks] == [r[0]["idx"] for r in ranks]  # each rank read the same samples
    assert not set(i for b in ranks[0][1]["idx"] for i in b) & set(i for b in ranks[1][1]["idx"] for i in b)
    assert stopped["stopped_by"] == "SIGTERM" and resumed["start_step"] == max(stopped["losses"]) < 8
    assert stopped["losses"] | resumed["losses"] == shards["losses"]
    (one,) = run_workers(
        1,
        run_phases,
        [
            phase("one", "c_one", True, remove=[])
            | {
                "overrides": SHARDED
                + [
                    f"data.root={digit_shards}",
                    f"checkpoint.path={tmp_path}/c_one",
                    f"checkpoint.resume={tmp_path}/c_job/step_{resumed['start_step']}",
                ]
            }
        ],
    )
    (one,) = one
    assert one["start_step"] == resumed["start_step"]
    for step, loss in one["losses"].items():
        assert loss == pytest.approx(shards["losses"][step], rel=1e-5)


def test_open_shards_are_bounded_and_a_linked_folder_reads_the_same(digit_shards, tmp_path):
    linked = tmp_path / "linked"
    linked.mkdir()
    for path in digit_shards.iterdir():  # a dataset linked together from elsewhere (cp -rs, git-annex, DVC)
        (linked / path.name).symlink_to(path)
    split = read_index(linked)[1]["train"]
    reader, direct = ShardReader(split, max_open=2), ShardReader(read_index(digit_shards)[1]["train"])
    for position in (0, 600, 1200, 1, 601, 1437):  # across the 3 shards, back and forth
        assert reader(position) == direct(position)
        assert len(reader._files) <= 2


def test_a_class_without_training_samples_is_refused_as_for_a_folder(digit_shards, tmp_path):
    root = _copy(digit_shards, tmp_path)
    _edit_index(root, lambda i: i["classes"].append("ghost"))
    data = ImageDataConfig(root=str(root), format=ImageFormat.shards)
    classes = read_index(root)[0]
    with pytest.raises(ValueError, match="1 classes have no training samples: ghost"):
        split_samples(ImageSamples, data, "train", classes, Transform(data, 28, train=True), 0)


def test_a_folder_name_is_a_path_not_a_pattern_or_url(tmp_path, monkeypatch):
    image = tmp_path / "x.png"
    Image.new("RGB", (4, 4)).save(image)
    monkeypatch.chdir(tmp_path)  # relative names, as on a command line
    for name in ("w%s_100%", "pipe:touch PWNED;cat", "http:x"):
        split = write_shards(Path(name), ["a"], {"train": [(str(image), 0)]})["train"]
        assert split.root == Path(name) and ShardReader(split)(0) == image.read_bytes()
    assert not (tmp_path / "PWNED").exists()
