"""MNIST in torchvision's file layout: train/validation split of the training file, the test file.

Samples are dicts {"data": float [1, H, W] in [0, 1], "label": int, "idx": int}, where idx is the
sample's row in its MNIST file (train file for train and validation, test file for test). They take an
int or a core.data.datasets.EpochIndex and involve no randomness, so every call gives the same sample.
"""

from __future__ import annotations

import functools
import gzip
import logging
import math
import struct
import zlib
from pathlib import Path

import torch
from torch.utils.data import Dataset

from core.config.errors import ConfigError, DataError, MissingDataError
from core.data.datasets import PRNGResampleDataset, epoch_index
from recipes.mnist.config import MNISTDataConfig

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# MNIST's own proportions: 5,000 of the 60,000 training images are held out for validation.
DEFAULT_VAL_FRACTION = 5_000 / 60_000


class MNISTSamples(Dataset):
    """Rows `rows` of one MNIST file's images and labels (uint8 [N, H, W], int64 [N]), held in memory."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor):
        self.images, self.labels, self.rows = images, labels, rows

    def __len__(self) -> int:
        return len(self.rows)

    def fingerprint(self) -> bytes:
        """The split's rows, pixels and labels (core/data/fingerprint.py): a resume notices another file."""
        parts = (self.rows, self.labels[self.rows], self.images[self.rows])
        return b"".join(t.contiguous().numpy().tobytes() for t in parts)

    def __getitem__(self, index) -> dict:
        row = int(self.rows[epoch_index(index).idx])
        return {"data": self.images[row].unsqueeze(0).float().div(255.0), "label": int(self.labels[row]), "idx": row}


# The most an IDX file may hold: far beyond MNIST-style sets (EMNIST's largest file is about half of it).
MAX_IDX_BYTES = 1 << 30

FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format), plain or gzip-compressed; DataError naming it if it is
    not one (memory bounded by what the file holds, not by what its header claims)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            magic = int.from_bytes(head, "big") if len(head) == 4 else -1
            dims = magic & 0xFF
            if magic >> 8 != 0x08 or dims not in (1, 3):
                raise DataError(f"{path}: not an IDX file of unsigned bytes (magic number {head.hex() or 'missing'})")
            sizes = f.read(4 * dims)
            if len(sizes) != 4 * dims:
                raise DataError(f"{path}: cut short inside its header")
            shape = struct.unpack(f">{dims}I", sizes)
            _check_size(path, shape)
            body = _read_up_to(f, math.prod(shape) + 1)
    except (OSError, EOFError, zlib.error) as e:  # unreadable, or a damaged or cut gzip stream
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if len(body) != math.prod(shape):
        raise DataError(
            f"{path}: {len(body)}{'+' if len(body) > math.prod(shape) else ''} bytes of data, but the "
            f"header says {shape} (truncated?)"
        )
    return torch.frombuffer(body, dtype=torch.uint8).reshape(shape)


def _check_size(path: Path, shape: tuple[int, ...]) -> None:
    """DataError naming `path` when its header declares no data, or more than MAX_IDX_BYTES (before any is read:
    a few MB of gzip can expand to gigabytes)."""
    if math.prod(shape) == 0:
        raise DataError(f"{path}: the header says {shape}: no data")
    if math.prod(shape) > MAX_IDX_BYTES:
        raise DataError(
            f"{path}: the header says {shape}, {math.prod(shape)} bytes, more than the {MAX_IDX_BYTES} an MNIST-style "
            "file is read up to (damaged, or a decompression bomb)"
        )


def _read_up_to(f, limit: int, chunk: int = 1 << 24) -> bytearray:
    """At most `limit` bytes of `f`, read in chunks: a header may claim far more than the file holds."""
    out = bytearray()
    while len(out) < limit:
        piece = f.read(min(chunk, limit - len(out)))
        if not piece:
            break
        out += piece
    return out


def _find(raw: Path, name: str) -> Path | None:
    return next((p for p in (raw / name, raw / f"{name}.gz") if p.is_file()), None)


@functools.lru_cache(maxsize=2)  # train and validation come from the same file: read it once
def read_mnist_file(root: str, train: bool, download: bool, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (uint8 [N, H, W]) and labels (int64 [N], each in 0..num_classes-1) of MNIST's training (train=True)
    or test file in `<root>/MNIST/raw/`, plain or .gz; torchvision fetches the real MNIST there first when
    `download`. DataError naming data.root and the file for what cannot be used."""
    raw = Path(root) / "MNIST" / "raw"
    names = FILES[train]
    if download and not all(_find(raw, n) for n in names):
        from torchvision.datasets import MNIST

        log.info("downloading MNIST into %s", raw)
        MNIST(root, train=train, download=True)
    paths = [_find(raw, n) for n in names]
    if not all(paths):
        raise MissingDataError(
            f"data.root={root}: no MNIST {'training' if train else 'test'} files ({names[0]}[.gz], {names[1]}[.gz]) "
            f"in {raw}: point data.root at a folder that has them, or set data.download=true to fetch the real "
            "MNIST there"
        )
    try:
        images, labels = read_idx(paths[0]), read_idx(paths[1])
    except DataError as e:
        raise DataError(f"data.root={root}: {e}") from None
    if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
        raise DataError(
            f"data.root={root}: {raw}: {tuple(images.shape)} images do not match {tuple(labels.shape)} labels"
        )
    # A label past the classifier's head would end training in a traceback from cross_entropy.
    outside = (labels >= num_classes).nonzero()
    if len(outside):
        row = int(outside[0])
        raise DataError(
            f"data.root={root}: {paths[1]}: label {int(labels[row])} at row {row} ({len(outside)} rows in all) is "
            f"outside 0..{num_classes - 1} (model.num_classes={num_classes}): not MNIST's labels"
        )
    return images, labels.long()


def train_val_rows(n: int, val_size: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random split of n training-file rows into (train rows, validation rows), neither empty."""
    n_val = round(n * DEFAULT_VAL_FRACTION) if val_size is None else val_size
    if not 1 <= n_val < n:
        raise ConfigError(
            f"data.val_size={val_size}: expected 1 <= val_size < {n} (the training file's samples; null: 1/12 of them)"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[n_val:], order[:n_val]


def build_mnist_split(data: MNISTDataConfig, split: str, image_size: int, num_classes: int = 10) -> Dataset:
    """One of train (shuffled by the training loop), val or test (each in a PRNGResampleDataset order
    from its own seed: every sample exactly once); labels checked to be below `num_classes`."""
    if split not in SPLITS:
        raise ConfigError(f"predict.split={split}: expected one of {', '.join(SPLITS)}")
    images, labels = read_mnist_file(data.root, split != "test", data.download, num_classes)
    if tuple(images.shape[1:]) != (image_size, image_size):  # the model takes any size the files hold
        raise ConfigError(
            f"model.image_size={image_size}, but the images under data.root={data.root} are "
            f"{images.shape[1]} x {images.shape[2]}"
        )
    if split == "test":
        return PRNGResampleDataset(
            MNISTSamples(images, labels, torch.arange(len(images))), seed=data.test_seed, replacement=False
        )
    train_rows, val_rows = train_val_rows(len(images), data.val_size, data.split_seed)
    if split == "train":
        return MNISTSamples(images, labels, train_rows)
    return PRNGResampleDataset(MNISTSamples(images, labels, val_rows), seed=data.val_seed, replacement=False)
