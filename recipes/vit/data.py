"""Image-classification datasets for the ViT recipe: ImageFolder, Tiny-ImageNet and synthetic.

Every dataset returns dict samples {"image": float tensor [C, H, W], normalized; "label": int}.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tarfile
from pathlib import Path
from typing import Callable, Optional

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from recipes.vit.config import ImageDataConfig, ViTModelConfig

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def ensure_extracted(root: str) -> Path:
    """Return `root`; if it is missing but `<root>.tar.gz` (.tgz, .tar) exists, extract it first.

    Safe with many ranks and nodes: one process extracts under a file lock into a temporary folder
    and renames it into place, so nobody ever sees a half-extracted root.
    """
    path = Path(root)
    if path.exists():
        return path
    archive = next((Path(root + s) for s in ARCHIVE_SUFFIXES if Path(root + s).exists()), None)
    if archive is None:
        raise FileNotFoundError(
            f"data root {root} does not exist (and no {root}.tar.gz beside it); set data.root to your dataset"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = Path(f"{root}.extracting-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("extracting %s -> %s", archive, root)
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            entries = list(tmp.iterdir())
            # An archive usually holds one top folder (e.g. tiny-imagenet-200/): that folder is the root.
            source = entries[0] if len(entries) == 1 and entries[0].is_dir() else tmp
            os.rename(source, path)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


class DictSamples(Dataset):
    """Wrap an (image, label) dataset into {"image", "label"} samples."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict:
        image, label = self.base[index]
        return {"image": image, "label": label}


class TinyImageNet(Dataset):
    """Tiny-ImageNet-200 layout: train/<wnid>/images/*.JPEG; val/images/*.JPEG with labels in
    val/val_annotations.txt (file, wnid, box). Classes are the sorted training wnids."""

    def __init__(self, root: Path, split: str, transform: Callable):
        self.transform = transform
        train_dir = root / "train"
        self.classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
        index = {wnid: i for i, wnid in enumerate(self.classes)}
        if split == "train":
            self.samples = [
                (str(f), index[wnid]) for wnid in self.classes for f in sorted((train_dir / wnid / "images").iterdir())
            ]
        else:
            lines = (root / split / "val_annotations.txt").read_text().splitlines()
            self.samples = [
                (str(root / split / "images" / parts[0]), index[parts[1]])
                for parts in (line.split("\t") for line in lines if line.strip())
            ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label


class SyntheticImages(Dataset):
    """Random normal images and uniform labels, the same for a given index on every call and rank."""

    def __init__(self, size: int, image_size: int, channels: int, num_classes: int, seed: int):
        self.size, self.shape, self.num_classes, self.seed = size, (channels, image_size, image_size), num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return {"image": torch.randn(self.shape, generator=g),
                "label": int(torch.randint(self.num_classes, (), generator=g))}


def train_transform(data: ImageDataConfig, image_size: int) -> Callable:
    ops = [v2.RandomResizedCrop(image_size, scale=tuple(data.train_crop_scale), ratio=tuple(data.train_crop_ratio),
                                antialias=True)]
    if data.hflip > 0:
        ops.append(v2.RandomHorizontalFlip(data.hflip))
    return v2.Compose([v2.PILToTensor(), *ops, v2.ToDtype(torch.float32, scale=True), v2.Normalize(data.mean, data.std)])


def val_transform(data: ImageDataConfig, image_size: int) -> Callable:
    return v2.Compose([
        v2.PILToTensor(),
        v2.Resize(round(image_size / data.val_crop_fraction), antialias=True),
        v2.CenterCrop(image_size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(data.mean, data.std),
    ])


def build_image_datasets(data: ImageDataConfig, model: ViTModelConfig, seed: int) -> tuple[Dataset, Optional[Dataset]]:
    size = model.img_size
    if data.format == "synthetic":
        return (SyntheticImages(data.synthetic_train_size, size, model.in_chans, model.num_classes, seed),
                SyntheticImages(data.synthetic_val_size, size, model.in_chans, model.num_classes, seed + 1))
    if data.root is None:
        raise ValueError(f"data.root must be set for data.format={data.format}")
    root = ensure_extracted(data.root)
    if data.format == "imagefolder":
        train = datasets.ImageFolder(str(root / data.train_split), transform=train_transform(data, size))
        val_dir = root / data.val_split
        val = datasets.ImageFolder(str(val_dir), transform=val_transform(data, size)) if val_dir.exists() else None
        if val is not None and val.classes != train.classes:
            raise ValueError(f"{val_dir} has classes {val.classes[:5]}..., unlike {root / data.train_split}")
        classes = train.classes
    elif data.format == "tiny_imagenet":
        train = TinyImageNet(root, data.train_split, train_transform(data, size))
        val = TinyImageNet(root, data.val_split, val_transform(data, size))
        classes = train.classes
    else:
        raise ValueError(f"data.format={data.format!r}: expected imagefolder, tiny_imagenet or synthetic")
    if len(classes) != model.num_classes:
        raise ValueError(f"{root} has {len(classes)} classes but model.num_classes={model.num_classes}")
    return DictSamples(train), (DictSamples(val) if val is not None else None)
