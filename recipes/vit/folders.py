"""Which images and classes a dataset folder holds, as folders are found in the wild.

Layouts:
  imagefolder    <split>/<class>/**/<image>   classes: the class folders of the training split that hold images
  tiny_imagenet  train/<wnid>/images/<image>, val/images/<image> labelled by val/val_annotations.txt
                 (file, wnid, box); classes: the training wnids with images, in wnids.txt order
  unlabeled      <folder>/**/<image>          prediction inputs, no labels

What is left out, and said so in the log (never an error unless nothing is left):
  - names starting with "." (.DS_Store, .ipynb_checkpoints, ._ resource forks): never classes or images;
  - files without an image extension (box files, READMEs, CSVs);
  - class folders without images (a subset that kept empty folders);
  - image files whose header cannot be read (zero bytes, truncated, not an image, a FIFO) or does not fit the
    file's size (recipes/vit/image_header.py): checked once when the dataset is built, in parallel threads
    (data.verify_images=false skips the check: a bad file then stops training when a worker reads it, naming the
    file);
  - Tiny-ImageNet validation lines whose file is missing or whose class has no training images (a subset
    that kept the full 10,000-line annotations file);
  - links to a folder visited already or above the one walked (loops: core/data/folder_walk.py), and folders that
    cannot be listed.

What cannot be used is a DataError naming the folder or file (recipes/vit/data.py adds the setting that gave
it); one that is not there a MissingDataError.
"""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

from core.config.errors import DataError, MissingDataError
from core.config.file_shape import open_regular_file, shown
from core.data.folder_walk import folder_key, name_loops, real_ancestors, visible, walk
from core.data.text_lines import bounded_lines
from recipes.vit.image_header import header_problem

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# Bounds on wnids.txt and val_annotations.txt, far beyond what Tiny-ImageNet's hold (a wnid, a file name, a box).
MAX_LINE_CHARACTERS = 4096
MAX_INDEX_BYTES = 64 << 20

Files = list[tuple[str, int]]  # (path, label); label -1: unlabeled


def is_image_name(name: str) -> bool:
    return visible(name) and name.lower().endswith(IMAGE_EXTENSIONS)


def images_under(
    folder: Path, taken: Optional[set[tuple[int, int]]] = None, others: Optional[list[Path]] = None
) -> list[Path]:
    """Image files under `folder` (any depth, hidden folders skipped), in sorted path order; `taken`: folders not to
    enter, shared by the walks of one split (core/data/folder_walk.py); the other files are added to `others`."""
    images = []
    for parent, names in walk(folder, taken=taken):
        for name in names:
            if is_image_name(name):
                images.append(parent / name)
            elif others is not None:
                others.append(parent / name)
    return sorted(images)


def name_others(where: Path, others: list[Path]) -> None:
    """One log line for the files left out for their extension (a .gif, a README): some may be images."""
    if others:
        log.warning(
            "%s: left out %d files without an image extension (%s): %s%s",
            where,
            len(others),
            ", ".join(IMAGE_EXTENSIONS),
            ", ".join(str(p) for p in sorted(others)[:3]),
            " ..." if len(others) > 3 else "",
        )


def _has_images(folder: Path, others: Optional[set[tuple[int, int]]] = None) -> bool:
    """Whether `folder` holds an image, not counting those of the folders `others` (the split's other classes)."""
    taken = None if others is None else set(others)  # a copy: this walk stops early, its record is not the split's
    return any(is_image_name(n) for _, names in walk(folder, taken=taken) for n in names)


def _subfolders(folder: Path) -> list[Path]:
    """The visible folders in `folder` (links to folders included), without links to `folder` itself or a folder
    above it (such a class folder would hold every class: a loop), nor a second way to a folder listed already."""
    return _distinct([p for p in sorted(folder.iterdir()) if visible(p.name) and p.is_dir()], folder)


def _distinct(folders: list[Path], where: Path) -> list[Path]:
    """`folders` (in their order) without those whose real folder is one of the others' (kept under its real path
    where there is one) or `where` or above it, named in a warning: its images would train under two labels."""
    above = real_ancestors(where)
    keys: set[tuple[int, int]] = set()
    repeated = []
    for p in sorted(folders, key=lambda p: p.is_symlink()):  # real folders first, each group in its order
        key = folder_key(p)
        if key in above or key in keys:
            repeated.append(p)
        keys.add(key)
    name_loops(where, repeated)
    return [p for p in folders if p not in repeated]


def _keys(folders: list[Path]) -> set[tuple[int, int]]:
    """The record of a split's walks, started with its class folders: none is entered from another class."""
    return {folder_key(p) for p in folders}


def _header_error(path: str) -> Optional[str]:
    try:
        with open_regular_file(path, follow_symlinks=True) as f:  # a FIFO would block
            return header_problem(f)
    except Exception as e:  # noqa: BLE001  (PIL raises many types for bad files)
        return f"{type(e).__name__}: {e}"


def readable(files: Files, where: str, threads: int = 16) -> Files:
    """`files` without those whose image header cannot be read; logs how many were left out and a few names."""
    with ThreadPoolExecutor(threads) as pool:
        errors = list(pool.map(_header_error, [path for path, _ in files]))
    bad = [(path, error) for (path, _), error in zip(files, errors) if error]
    if bad:
        shown = "; ".join(f"{p} ({e})" for p, e in bad[:3])
        log.warning(
            "%s: left out %d of %d image files that cannot be read: %s%s",
            where,
            len(bad),
            len(files),
            shown,
            " ..." if len(bad) > 3 else "",
        )
    return [f for f, error in zip(files, errors) if not error]


# --- ImageFolder -------------------------------------------------------------------------------------


def imagefolder_classes(split_dir: Path) -> list[str]:
    """The class folders of `split_dir` that hold images, sorted by name."""
    if not split_dir.is_dir():
        raise MissingDataError(f"{split_dir}: no such folder (expected <root>/<split>/<class>/<image>)")
    folders = _subfolders(split_dir)
    others = _keys(folders)
    classes = [f.name for f in folders if _has_images(f, others)]
    empty = [f.name for f in folders if f.name not in classes]
    if empty:
        log.warning("%s: left out %d class folders without images: %s", split_dir, len(empty), ", ".join(empty[:5]))
    if not classes:
        raise DataError(
            f"{split_dir} has no class folders with images (expected <split>/<class>/<image>, "
            f"image files ending in {', '.join(IMAGE_EXTENSIONS)})"
        )
    return classes


def imagefolder_files(split_dir: Path, classes: list[str]) -> Files:
    """(image, label) for every image of the given classes; class folders of `split_dir` that are not among
    them (a class without training images) are left out and logged."""
    index = {c: i for i, c in enumerate(classes)}
    folders = {f.name: f for f in _subfolders(split_dir)}
    taken = _keys(list(folders.values()))
    others = [name for name, f in folders.items() if name not in index and _has_images(f, taken)]
    if others:
        log.warning(
            "%s: left out %d class folders that the training split does not have: %s",
            split_dir,
            len(others),
            ", ".join(others[:5]),
        )
    others_files: list[Path] = []
    files = [(str(p), index[c]) for c in classes if c in folders for p in images_under(folders[c], taken, others_files)]
    name_others(split_dir, others_files)
    return files


# --- Tiny-ImageNet -----------------------------------------------------------------------------------


def tiny_imagenet_classes(root: Path) -> list[str]:
    """The wnids with training images, in wnids.txt order (sorted when there is no wnids.txt; wnids that
    wnids.txt lacks come last, sorted). A subset with the full wnids.txt gets its own classes only.
    The full Tiny-ImageNet-200's wnids.txt is not sorted: its label ids are not those of sorted folder names
    (torchvision's ImageFolder order), on purpose, so that a subset and the full set agree with the file."""
    train = root / "train"
    if not train.is_dir():
        raise MissingDataError(f"{train}: no such folder (Tiny-ImageNet: train/<wnid>/images/<image>)")
    folders = _images_folders(train, [f.name for f in _subfolders(train)])
    others = _keys(folders)
    present = {f.parent.name for f in folders if _has_images(f, others)}
    if not present:
        raise DataError(
            f"{train} has no <wnid>/images/ folders with images (Tiny-ImageNet: train/<wnid>/images/<image>)"
        )
    listed = [w.strip() for w in _lines(root / "wnids.txt")] if _there(root / "wnids.txt") else []
    ordered = [w for w in dict.fromkeys(listed) if w in present]
    unlisted = sorted(present - set(ordered))
    if listed and unlisted:
        log.warning(
            "%s: %d training classes are not in wnids.txt and come after its classes: %s",
            root,
            len(unlisted),
            ", ".join(unlisted[:5]),
        )
    if len(ordered) < len(listed):
        log.info(
            "%s: %d of the %d classes in wnids.txt have training images (a subset)",
            root,
            len(ordered),
            len(set(listed)),
        )
    return ordered + unlisted


def _images_folders(train: Path, wnids: list[str]) -> list[Path]:
    """The `train/<wnid>/images` folders there are, each real folder once (a second way to one is named)."""
    return _distinct([train / w / "images" for w in wnids if (train / w / "images").is_dir()], train)


def tiny_imagenet_files(root: Path, split: str, classes: list[str]) -> Optional[Files]:
    """(image, label) of a split: train/<wnid>/images/*, or the annotated validation files that exist and
    belong to a training class (an ImageFolder-style <split>/<wnid>/ also works). None without the split."""
    index = {w: i for i, w in enumerate(classes)}
    if split == "train":
        folders = _images_folders(root / "train", classes)
        taken = _keys(folders)
        others: list[Path] = []
        files = [(str(p), index[f.parent.name]) for f in folders for p in images_under(f, taken, others)]
        name_others(root / "train", others)
        return files
    folder = root / split
    if not folder.is_dir():
        return None
    annotations = folder / f"{split}_annotations.txt"
    if not _there(annotations):
        return imagefolder_files(folder, classes)
    files, missing, other_class, malformed = [], 0, 0, 0
    for entry in _annotated(annotations):
        if entry is None:
            malformed += 1
            continue
        name, wnid = entry
        if wnid not in index:
            other_class += 1
        elif not (folder / "images" / name).is_file():
            missing += 1
        else:
            files.append((str(folder / "images" / name), index[wnid]))
    if missing or other_class or malformed:
        log.info(
            "%s: %d annotated images; left out %d lines of classes without training images, %d of files "
            "that are missing%s",
            annotations,
            len(files),
            other_class,
            missing,
            f", {malformed} malformed" if malformed else "",
        )
    if not files:
        raise DataError(
            f"{annotations}: none of its lines names an existing file of a training class "
            f"({other_class} other classes, {missing} missing files)"
        )
    return files


def _annotated(annotations: Path) -> Iterator[Optional[tuple[str, str]]]:
    """(file name, wnid) of each line of an annotations file, None for a line without both (blank lines skipped).
    DataError naming the file and line for a name that is not a plain image file name (a path elsewhere, `../`,
    another kind of file: shard_images.py would copy it into the shards) or one named twice (a second label)."""
    first_line: dict[str, int] = {}
    for number, line in enumerate(_lines(annotations), 1):
        parts = line.split()
        if len(parts) < 2:
            if parts:
                yield None
            continue
        name = parts[0]
        if Path(name).name != name or not is_image_name(name):
            raise DataError(
                f"{annotations}:{number}: {shown(name)} is not the name of an image file in "
                f"{annotations.parent / 'images'} (a plain name ending in {', '.join(IMAGE_EXTENSIONS)})"
            )
        if name in first_line:
            raise DataError(f"{annotations}:{number}: {name} is annotated again (first on line {first_line[name]})")
        first_line[name] = number
        yield name, parts[1]


def _there(path: Path) -> bool:
    """Whether there is something named `path`: one that cannot be read (a dangling link, a FIFO) is then refused
    by _lines, naming it, rather than passed over (a missing wnids.txt changes the classes' order)."""
    return path.is_symlink() or path.exists()


def _lines(path: Path) -> Iterator[str]:
    """A text file's lines, each read with a bound (a sparse file or a bomb of one endless line is refused at it);
    DataError naming the file (and line) if it cannot be read as text or is far larger than an index file."""

    def too_long(number: int) -> DataError:
        return DataError(f"{path}:{number}: a line longer than {MAX_LINE_CHARACTERS} characters: not an index file")

    try:
        with open_regular_file(path, follow_symlinks=True) as raw:  # a FIFO would block
            if os.fstat(raw.fileno()).st_size > MAX_INDEX_BYTES:
                raise DataError(f"{path}: larger than {MAX_INDEX_BYTES} bytes: not an index file")
            with io.TextIOWrapper(raw, encoding="utf-8") as f:
                for line in bounded_lines(f, MAX_LINE_CHARACTERS, too_long):
                    yield line.rstrip("\r\n")
    except DataError:
        raise
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 (UnicodeDecodeError), not a regular file
        raise DataError(f"{path}: cannot be read as a text file ({type(e).__name__}: {e})") from None


# --- unlabeled ---------------------------------------------------------------------------------------


def unlabeled_files(folder: Path) -> Files:
    """Every image under `folder` (any depth), in sorted path order, label -1."""
    if not folder.is_dir():
        raise MissingDataError(f"{folder}: no such folder")
    others: list[Path] = []
    files = [(str(p), -1) for p in images_under(folder, others=others)]
    name_others(folder, others)
    if not files:
        raise DataError(f"{folder} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    return files
