"""Image datasets in tar shards (WebDataset layout) with an index, read by sample position.

A folder of single files is slow on shared filesystems at ImageNet scale; the field reads tar shards.
`scripts/shard_images.py` writes them with WebDataset's ShardWriter:

    <out>/<split>-000000.tar ...   members <position:08d>.cls (the label, ASCII) and <position:08d>.<ext>
    <out>/<split>.npy              per sample: shard, header offset, data offset, size, label (int64)
    <out>/index.json               format, classes, and per split its shards (name, bytes, samples)

Training reads a sample by its position with one positioned read of its image's bytes, so the project's
sampler keeps its rules unchanged (the same global order for any number of loader workers, disjoint samples
per rank, exact mid-epoch resume, on any number of GPUs). Every file is read as possibly hostile: the index
is checked against the shards' sizes before any work (no member longer than any image file may be: each read
takes one whole), and each read checks the member's tar header (its checksum, name and size) against the index,
so a wrong offset or a damaged shard is an error naming both, never another sample's bytes, and its image header
against its size (recipes/vit/image_header.py) before it is decoded.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, NonNegativeInt, StrictInt, ValidationError

from core.config.errors import DataError, MissingDataError
from core.config.file_shape import problems, read_small_file
from recipes.vit.image_header import DECODE_ERRORS, MOST_FILE_BYTES, header_problem, read_image_file, rgb

INDEX = "index.json"
FORMAT = "vit-image-shards"
BLOCK = 512  # tar's block: every member header starts on one
COLUMNS = ("shard", "header_offset", "data_offset", "size", "label")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class _Plain(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ShardEntry(_Plain):
    name: str
    bytes: NonNegativeInt
    samples: NonNegativeInt


class SplitEntry(_Plain):
    table: str
    shards: list[ShardEntry]


class IndexFile(_Plain):
    format: Literal["vit-image-shards"]
    version: StrictInt  # 1 (checked below: a Literal would take true for 1)
    classes: list[str]
    splits: dict[str, SplitEntry]


def _member_key(position: int) -> str:
    return f"{position:08d}"


def _plain_name(name: str, suffix: str) -> bool:
    """A file name of the shard folder itself: no path, nothing hidden."""
    return bool(_PLAIN_NAME.fullmatch(name)) and not name.startswith(".") and name.endswith(suffix)


@dataclass(frozen=True)
class ShardSplit:
    """One split of a shard folder, checked: its shard files and its per-sample table."""

    root: Path
    name: str
    shards: list[ShardEntry]
    table_name: str
    table: np.ndarray  # int64 [samples, 5]: COLUMNS, memory-mapped

    def __reduce__(self):  # a loader worker maps the table itself instead of receiving a copy of it
        return _mapped_split, (self.root, self.name, self.shards, self.table_name)

    def __len__(self) -> int:
        return len(self.table)

    def labels(self) -> list[int]:
        return self.table[:, 4].tolist()

    def member(self, position: int) -> str:
        """`<shard>:<member>` of the sample at `position`, for messages."""
        return f"{self.shards[int(self.table[position, 0])].name}:{_member_key(position)}"


def read_index(root: str | Path) -> tuple[list[str], dict[str, ShardSplit]]:
    """The classes and the splits of the shard folder `root`, checked before any work: index.json's shape,
    plain file names, each shard's size, and every table row (its shard, 512-aligned offsets, the data right
    after a plain header and inside the shard, a label of the classes). DataError naming the file."""
    root = Path(root)
    index_path = root / INDEX
    try:  # links are followed, as for the shards (a dataset linked together from another place is common)
        raw = read_small_file(index_path, 64 << 20, follow_symlinks=True)
    except FileNotFoundError:
        raise MissingDataError(
            f"{index_path}: no such file (data.format=shards reads a folder that scripts/shard_images.py wrote)"
        ) from None
    except (ValueError, OSError) as e:
        raise DataError(f"{index_path}: {e}") from None
    try:
        index = IndexFile.model_validate(json.loads(raw, object_pairs_hook=_no_repeated_keys))
    except ValidationError as e:
        raise DataError(f"{index_path}: {problems(e)}") from None
    except (ValueError, RecursionError) as e:  # not JSON, a key given twice, a number of thousands of digits
        raise DataError(f"{index_path}: not an index of this format ({str(e)[:200]})") from None
    if index.version != 1:
        raise DataError(f"{index_path}: version={index.version}: this code reads version 1")
    if not index.classes or len(set(index.classes)) != len(index.classes):
        raise DataError(f"{index_path}: classes must be a non-empty list of distinct names")
    files = [entry.table for entry in index.splits.values()] + [s.name for e in index.splits.values() for s in e.shards]
    if len(set(files)) != len(files):
        raise DataError(f"{index_path}: a file is named twice (each split has its own table and shards)")
    splits = {name: _read_split(root, name, entry, len(index.classes)) for name, entry in index.splits.items()}
    return index.classes, splits


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} is given twice")
    return dict(pairs)


def _read_split(root: Path, split: str, entry: SplitEntry, num_classes: int) -> ShardSplit:
    where = root / INDEX
    names = [entry.table] + [s.name for s in entry.shards]
    if not _plain_name(entry.table, ".npy") or not all(_plain_name(s.name, ".tar") for s in entry.shards):
        raise DataError(f"{where}: split {split!r} names a file that is not a plain .tar/.npy name of the folder")
    if len(set(names)) != len(names):
        raise DataError(f"{where}: split {split!r} names a file twice")
    if not entry.shards:
        raise DataError(f"{where}: split {split!r} has no shards")
    for shard in entry.shards:
        _expect_regular(root / shard.name, shard.bytes)
    table_path = root / entry.table
    _expect_regular(table_path, None)
    try:
        table = np.load(table_path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise DataError(f"{table_path}: not a table of this format ({e})") from None
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != len(COLUMNS):
        raise DataError(f"{table_path}: expected int64 rows of {', '.join(COLUMNS)}; found {table.dtype} {table.shape}")
    if len(table) != sum(s.samples for s in entry.shards):
        raise DataError(
            f"{table_path}: {len(table)} rows, but {where} counts "
            f"{sum(s.samples for s in entry.shards)} samples in split {split!r}"
        )
    shard, header, data, size, label = (np.asarray(table[:, i]) for i in range(len(COLUMNS)))
    ends = np.asarray([s.bytes for s in entry.shards], dtype=np.int64)
    expected_shard = np.repeat(np.arange(len(entry.shards)), [s.samples for s in entry.shards])
    bad = ~(
        (shard == expected_shard)
        & (header >= 0)
        & (header % BLOCK == 0)
        & (data == header + BLOCK)
        & (size >= 0)
        & (label >= 0)
        & (label < num_classes)
    )
    if not bad.any():  # the shard ids are right: each member must lie inside its shard (no sum that can wrap)
        bad = (header > ends[shard]) | (size > ends[shard]) | (data + size > ends[shard])
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{table_path}: row {row} ({dict(zip(COLUMNS, table[row].tolist()))}) does not point "
            f"at a member of its shard (or its label is not one of the {num_classes} classes)"
        )
    if (size > MOST_FILE_BYTES).any():  # each read takes the whole member into memory
        row = int(np.flatnonzero(size > MOST_FILE_BYTES)[0])
        raise DataError(
            f"{table_path}: row {row} gives the image {entry.shards[int(shard[row])].name}:{_member_key(row)} "
            f"{int(size[row]):,} bytes, more than any image file may be here (at most {MOST_FILE_BYTES:,})"
        )
    return ShardSplit(root, split, list(entry.shards), entry.table, table)


def _mapped_split(root: Path, name: str, shards: list[ShardEntry], table_name: str) -> ShardSplit:
    return ShardSplit(root, name, shards, table_name, np.load(root / table_name, mmap_mode="r", allow_pickle=False))


class ShardFiles:
    """A split's samples as (`<shard>:<member>`, label) by position, like a folder's (file, label) list."""

    def __init__(self, split: ShardSplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, position: int) -> tuple[str, int]:
        return self.split.member(position), int(self.split.table[position, 4])

    def fingerprint(self) -> bytes:
        """The shards' names and the sample table (where each sample lies, its label), for
        core/data/fingerprint.py: one pass over the mapped table, not a string per sample."""
        names = "\n".join(shard.name for shard in self.split.shards).encode("utf-8", "surrogateescape")
        return names + b"\0" + np.ascontiguousarray(self.split.table).tobytes()


def _expect_regular(path: Path, size: Optional[int]) -> None:
    try:
        status = os.stat(path, follow_symlinks=True)
    except FileNotFoundError:
        raise DataError(f"{path}: listed in {path.parent / INDEX} but not there") from None
    except OSError as e:  # e.g. a link to itself
        raise DataError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise DataError(f"{path}: not a regular file")
    if size is not None and status.st_size != size:
        raise DataError(
            f"{path}: {status.st_size} bytes, but {path.parent / INDEX} says {size} (a copy cut "
            "short or changed since it was written)"
        )


class ShardReader:
    """The image bytes of a split's samples by position: one positioned read of the member's header and data.
    Picklable for loader workers; each process opens the shards itself, keeping at most `max_open` open."""

    MAX_OPEN = 64  # thousands of shards would otherwise use up the process's file descriptors

    def __init__(self, split: ShardSplit, max_open: int = MAX_OPEN):
        self.split, self.max_open = split, max_open
        self._pid, self._files = None, collections.OrderedDict()

    def __getstate__(self) -> dict:
        return {"split": self.split, "max_open": self.max_open, "_pid": None, "_files": collections.OrderedDict()}

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors are not ours to share offsets
            self._pid, self._files = os.getpid(), collections.OrderedDict()
        if shard in self._files:
            self._files.move_to_end(shard)
            return self._files[shard]
        path = self.split.root / self.split.shards[shard].name
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO would block
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the index was checked
            os.close(fd)
            raise DataError(f"{path}: not a regular file")
        self._files[shard] = fd
        if len(self._files) > self.max_open:
            os.close(self._files.popitem(last=False)[1])
        return fd

    def __call__(self, position: int) -> bytes:
        shard, header, _, size, _ = (int(v) for v in self.split.table[position])
        where = self.split.root / self.split.member(position)
        if size > MOST_FILE_BYTES:  # the table may have changed since it was checked; it is read whole below
            raise DataError(f"{where}: the index gives this image {size:,} bytes, more than any image file may be")
        try:
            block = os.pread(self._fd(shard), BLOCK + size, header)
        except OSError as e:
            raise DataError(f"{where}: cannot read the shard ({e.strerror})") from None
        try:
            info = tarfile.TarInfo.frombuf(block[:BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise DataError(
                f"{where}: no tar header where the index points ({e}); the shard is damaged or the index is not its own"
            ) from None
        stem, _, _ = info.name.partition(".")
        if stem != _member_key(position) or info.name.endswith(".cls") or info.size != size or not info.isreg():
            raise DataError(
                f"{where}: the index points at member {info.name!r} of {info.size} bytes, not this "
                f"sample's image of {size} bytes; the index is not this shard's"
            )
        if len(block) != BLOCK + size:
            raise DataError(f"{where}: the shard ends inside the member (cut short)")
        problem = header_problem(io.BytesIO(block[BLOCK:]), size)  # before the header is parsed unbounded
        if problem is not None:
            raise DataError(f"cannot decode the image {where} ({problem}); remove or replace it")
        return block[BLOCK:]


def write_shards(
    out: Path,
    classes: list[str],
    splits: dict[str, list[tuple[str, int]]],
    max_samples: int = 5000,
    shorter_side: Optional[int] = None,
    quality: int = 90,
) -> dict[str, ShardSplit]:
    """Write `splits` ({split: [(image file, label)]}) into tar shards of at most `max_samples` samples under
    `out` (a new or empty folder), with the index. Images keep their bytes, or with `shorter_side` are
    resized so (never enlarged) and stored as JPEG at `quality`. Returns the splits as read back. ValueError
    naming the file or split for what cannot be written; a failed write leaves no files of its own behind."""
    for split, files in splits.items():
        if not (_plain_name(f"{split}.npy", ".npy") and len(split) <= 100):
            raise ValueError(f"split name {split!r}: use up to 100 letters, digits, '_', '-' and '.'")
        if not files:
            raise ValueError(f"split {split!r} has no images to write")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        index = {"format": FORMAT, "version": 1, "classes": list(classes), "splits": {}}
        for split, files in splits.items():
            shard_files = _write_split(out, split, files, max_samples, shorter_side, quality, written)
            shards, rows = _index_shards(shard_files, [label for _, label in files])
            written.append(out / f"{split}.npy")
            np.save(written[-1], np.asarray(rows, dtype=np.int64).reshape(-1, len(COLUMNS)))
            index["splits"][split] = {"table": f"{split}.npy", "shards": shards}
        written.append(out / INDEX)
        written[-1].write_text(json.dumps(index, indent=1) + "\n")
        return read_index(out)[1]
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise


def _write_split(
    out: Path,
    split: str,
    files: list[tuple[str, int]],
    max_samples: int,
    shorter_side: Optional[int],
    quality: int,
    written: list[Path],
) -> list[Path]:
    """The split's shards, written with WebDataset's TarWriter on files opened here (its ShardWriter would
    read the folder's name as a URL pattern)."""
    import webdataset

    shard_files: list[Path] = []
    writer = None
    try:
        for position, (path, label) in enumerate(files):
            if position % max_samples == 0:
                if writer is not None:
                    writer.close()
                shard_files.append(out / f"{split}-{len(shard_files):06d}.tar")
                written.append(shard_files[-1])
                writer = webdataset.TarWriter(open(shard_files[-1], "xb"), encoder=False, mtime=0)
            image, ext = _image_bytes(path, shorter_side, quality)
            writer.write({"__key__": _member_key(position), "cls": str(label).encode(), ext: image})
    finally:
        if writer is not None:
            writer.close()
    return shard_files


_EXTENSION = re.compile(r"[a-z0-9]{1,10}")


def _image_bytes(path: str, shorter_side: Optional[int], quality: int) -> tuple[bytes, str]:
    """The file's bytes and extension (an unusual one stored as "img"), or its image resized to
    `shorter_side` as JPEG."""
    try:
        raw = read_image_file(path)
        ext = Path(path).suffix.lower().lstrip(".")
        ext = "jpg" if ext == "jpeg" else ext if _EXTENSION.fullmatch(ext) and ext != "cls" else "img"
        if shorter_side is None:
            return raw, ext
        with Image.open(io.BytesIO(raw)) as img:
            img = rgb(img)
            scale = shorter_side / min(img.size)
            if scale < 1:
                img = img.resize(
                    (max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BICUBIC
                )
            buffer = io.BytesIO()
            img.save(buffer, format="JPEG", quality=quality)
        return buffer.getvalue(), "jpg"
    except (ValueError, *DECODE_ERRORS) as e:  # read, decoded or resized: a bad file
        raise DataError(
            f"{path}: cannot be written into a shard ({type(e).__name__}: {e}); remove or replace it"
        ) from None


def _index_shards(shard_files: list[Path], labels: list[int]) -> tuple[list[dict], list[list[int]]]:
    """Each written shard's entry and the table rows of its samples, read back from the shards themselves."""
    shards, rows, position = [], [], 0
    for shard_id, path in enumerate(shard_files):
        count = 0
        with tarfile.open(path, "r:") as tar:
            members = tar.getmembers()
        for member in members:
            stem, _, ext = member.name.partition(".")
            if ext == "cls":
                continue
            if stem != _member_key(position) or member.offset_data != member.offset + BLOCK:
                raise RuntimeError(f"{path}: member {member.name} is not where the writer should have put it")
            rows.append([shard_id, member.offset, member.offset_data, member.size, labels[position]])
            position, count = position + 1, count + 1
        shards.append({"name": path.name, "bytes": path.stat().st_size, "samples": count})
    if position != len(labels):
        raise RuntimeError(f"{shard_files[0].parent}: the shards hold {position} images of {len(labels)}")
    return shards, rows
