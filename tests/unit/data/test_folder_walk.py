"""Image folders with links (core/data/folder_walk.py), as training, predict.folder and scripts/shard_images.py list
them: each real folder once; a link to a folder visited already or above is a loop, named in one warning and
not followed; a link to a folder elsewhere (a dataset assembled from links) and a linked image file count."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

from PIL import Image

from recipes.vit.folders import imagefolder_classes, imagefolder_files
from tests.support.helpers import REPO


def _images(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.new("RGB", (4, 4), (len(name) * 40 % 256, 20, 90)).save(folder / name)


def _two_classes(root: Path) -> Path:
    """<root>/train/{a,b}/ with 4 images each."""
    for c in ("a", "b"):
        _images(root / "train" / c, [f"{i}.png" for i in range(4)])
    return root / "train"


def _warnings_naming(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# The listing of an image folder (training's, twice: train and validation build it alike) or of predict.folder,
# printed as JSON with paths relative to the folder, and the warnings on stderr.
LIST = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from recipes.vit.folders import imagefolder_classes, imagefolder_files, unlabeled_files
kind, folder = sys.argv[1], Path(sys.argv[2])
if kind == "imagefolder":
    classes = imagefolder_classes(folder)
    files = imagefolder_files(folder, classes)
    assert imagefolder_files(folder, classes) == files
else:
    classes, files = None, unlabeled_files(folder)
print(json.dumps({"classes": classes, "files": [[Path(f).relative_to(folder).as_posix(), n] for f, n in files]}))
"""


def list_in_a_limited_process(kind: str, folder: Path) -> tuple[dict, list[str]]:
    """LIST in a process of its own, limited to 1 GiB of address space and 60 s: links that loop made
    os.walk(followlinks=True) list without end (memory past 3.7 GB), and a regression must fail, not hang."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run(
        [sys.executable, "-c", LIST, kind, str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout), proc.stderr.splitlines()


EIGHT = [[f"{c}/{i}.png", label] for label, c in enumerate("ab") for i in range(4)]


def test_a_link_to_its_own_folder_is_named_once_and_not_followed(tmp_path):
    train = _two_classes(tmp_path)
    (train / "a" / "self").symlink_to(".")
    listed, warnings = list_in_a_limited_process("imagefolder", train)
    assert listed == {"classes": ["a", "b"], "files": EIGHT}  # 8 samples, not 168
    assert len([w for w in warnings if f"{train / 'a' / 'self'} -> ." in w]) == 1


def test_links_to_the_folders_above_end_without_a_hang(tmp_path):
    train = _two_classes(tmp_path)
    for name in ("up1", "up2"):
        (train / "a" / name).symlink_to("..")
    (train / "b" / "top").symlink_to("../..")
    (train / "b" / "root").symlink_to("/")
    listed, warnings = list_in_a_limited_process("imagefolder", train)
    assert listed == {"classes": ["a", "b"], "files": EIGHT}
    for link, target in (("a/up1", ".."), ("a/up2", ".."), ("b/top", "../.."), ("b/root", "/")):
        assert len([w for w in warnings if f"{train / link} -> {target}" in w]) == 1, (link, warnings)


def test_links_to_folders_elsewhere_and_linked_images_count_once(tmp_path, caplog):
    """A dataset put together from links: a class folder linked in, a folder linked into a class, a linked image
    file. The same folder linked twice is listed once (under the first link, in name order)."""
    elsewhere = tmp_path / "elsewhere"
    _images(elsewhere / "cats", ["x.png", "y.png"])
    _images(elsewhere / "more", ["z.png"])
    train = tmp_path / "data" / "train"
    _images(train / "dog", ["1.png"])
    (train / "cat").symlink_to(elsewhere / "cats")
    (train / "dog" / "extra").symlink_to(elsewhere / "more")
    (train / "dog" / "twice").symlink_to(elsewhere / "more")
    (train / "dog" / "linked.png").symlink_to(elsewhere / "more" / "z.png")
    classes, files = _listed_with_warnings(train, caplog)
    assert classes == ["cat", "dog"]
    assert files == [
        ("cat/x.png", 0),
        ("cat/y.png", 0),
        ("dog/1.png", 1),
        ("dog/extra/z.png", 1),
        ("dog/linked.png", 1),
    ]
    assert len(_warnings_naming(caplog, f"{train / 'dog' / 'twice'} -> {elsewhere / 'more'}")) == 1


def test_a_real_folder_is_listed_under_its_own_path_before_a_link_to_it(tmp_path):
    train = _two_classes(tmp_path)
    _images(train / "b" / "zz_deep", ["d.png"])
    (train / "b" / "aa_link").symlink_to("zz_deep")  # comes first by name; the real folder still wins
    files = imagefolder_files(train, ["a", "b"])
    assert str(train / "b" / "zz_deep" / "d.png") in [f for f, _ in files]
    assert not any("aa_link" in f for f, _ in files) and len(files) == 9


def test_a_class_folder_linked_to_its_split_is_not_a_class(tmp_path):
    train = _two_classes(tmp_path)
    (train / "all").symlink_to(".")
    (train / "parent").symlink_to("..")
    listed, warnings = list_in_a_limited_process("imagefolder", train)
    assert listed == {"classes": ["a", "b"], "files": EIGHT}
    assert [w for w in warnings if f"{train / 'all'} -> ." in w]
    assert [w for w in warnings if f"{train / 'parent'} -> .." in w]


def test_predict_folder_walks_the_same_way(tmp_path):
    folder = tmp_path / "incoming"
    _images(folder / "batch", ["a.png", "b.png"])
    (folder / "batch" / "loop").symlink_to("..")
    (folder / "self").symlink_to(".")
    os.symlink("nowhere", folder / "broken.png")  # a dangling link: a file name, left out later as unreadable
    listed, warnings = list_in_a_limited_process("unlabeled", folder)
    assert listed["files"] == [["batch/a.png", -1], ["batch/b.png", -1], ["broken.png", -1]]
    assert [w for w in warnings if f"{folder / 'self'} -> ." in w] and [w for w in warnings if "batch/loop -> .." in w]


def test_a_folder_reached_from_two_classes_trains_under_one_label(tmp_path, caplog):
    """One record of visited folders per split: a second link to a class folder is no class, a link inside a class
    to another class is not followed, and a folder linked into two classes is listed under the first only."""
    train = _two_classes(tmp_path / "pets")
    _images(tmp_path / "shared", ["s.png"])
    (train / "kitten").symlink_to("a")  # a second link to the class folder a
    (train / "a" / "more").symlink_to("../b")  # a class reaching into another class
    (train / "a" / "x").symlink_to(tmp_path / "shared")
    (train / "b" / "y").symlink_to(tmp_path / "shared")
    classes, files = _listed_with_warnings(train, caplog)
    assert classes == ["a", "b"]
    assert files == [
        *map(tuple, EIGHT[:4]),
        ("a/x/s.png", 0),
        *map(tuple, EIGHT[4:]),
    ]
    for link, target in (("kitten", "a"), ("a/more", "../b"), ("b/y", str(tmp_path / "shared"))):
        assert len(_warnings_naming(caplog, f"{train / link} -> {target}")) == 1, (link, caplog.text)


def test_a_tiny_imagenet_images_folder_reached_twice_trains_under_one_label(tmp_path, caplog):
    from recipes.vit.folders import tiny_imagenet_classes, tiny_imagenet_files

    train = tmp_path / "train"
    for w in ("n01", "n02"):
        _images(train / w / "images", [f"{w}_{i}.JPEG" for i in range(2)])
    (train / "n03" / "images").parent.mkdir()
    (train / "n03" / "images").symlink_to("../n01/images")  # a second way to n01's images
    (train / "n04").symlink_to("n02")
    (train / "n01" / "images" / "more").symlink_to("../../n02/images")
    with caplog.at_level(logging.WARNING):
        classes = tiny_imagenet_classes(tmp_path)
        files = tiny_imagenet_files(tmp_path, "train", classes)
    assert classes == ["n01", "n02"]
    assert [(Path(f).relative_to(train).as_posix(), label) for f, label in files] == [
        ("n01/images/n01_0.JPEG", 0),
        ("n01/images/n01_1.JPEG", 0),
        ("n02/images/n02_0.JPEG", 1),
        ("n02/images/n02_1.JPEG", 1),
    ]
    for link, target in (("n03/images", "../n01/images"), ("n04", "n02"), ("n01/images/more", "../../n02/images")):
        assert len(_warnings_naming(caplog, f"{train / link} -> {target}")) == 1, (link, caplog.text)


def _listed_with_warnings(train: Path, caplog) -> tuple[list[str], list[tuple[str, int]]]:
    """The classes of `train` and its (file relative to it, label) pairs, with the warnings caught in caplog."""
    with caplog.at_level(logging.WARNING):
        classes = imagefolder_classes(train)
        files = imagefolder_files(train, classes)
    return classes, [(Path(f).relative_to(train).as_posix(), label) for f, label in files]
