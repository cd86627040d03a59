"""data.decode_on=device: the loader workers read JPEG bytes and draw the augmentation; the training device
decodes and transforms. Same crops, flips and labels as decoding in the workers (here the "device" is the
CPU: torchvision's libjpeg decoder instead of PIL's)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException
from PIL import Image

from core.config.errors import ConfigError
from core.data.datasets import EpochIndex
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, collate_encoded, decode_batch
from tests.helpers import REPO, compose_config, read_records

SIZES = [(40, 56), (64, 48), (33, 33), (80, 120), (50, 70), (45, 90)]


def write_jpeg_folder(root, classes=2, per_class=3):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                h, w = SIZES[(c * per_class + i) % len(SIZES)]
                # Smooth images: JPEG keeps them close, so the two decoders agree closely.
                y, x = np.mgrid[0:h, 0:w]
                img = np.stack([(x * 255 // w), (y * 255 // h), np.full((h, w), 40 + 60 * c)], -1)
                img = np.clip(img + rng.integers(-3, 4, img.shape), 0, 255).astype(np.uint8)
                mode = "L" if i == 2 else "RGB"  # a grayscale JPEG too
                Image.fromarray(img if mode == "RGB" else img[..., 0], mode).save(folder / f"{i}.jpg", quality=95)
    return root


def datasets(root, decode_on, **kw):
    data = ImageDataConfig(format="imagefolder", root=str(root), num_classes=2, decode_on=decode_on, **kw)
    return build_image_datasets(data, ViTModelConfig(img_size=32, num_classes=2), seed=7)


def test_device_decoding_gives_the_workers_images(tmp_path):
    root = write_jpeg_folder(tmp_path / "jpegs")
    for split in (0, 1):  # train (random crops and flips), val (resize + centre crop)
        plain, encoded = datasets(root, "workers")[split], datasets(root, "device")[split]
        keys = [EpochIndex(e, i) for e in (0, 1) for i in range(len(plain))]
        batch = decode_batch(collate_encoded([encoded[k] for k in keys]), encoded.transform, torch.device("cpu"))
        expected = torch.stack([plain[k]["image"] for k in keys])
        assert batch["image"].shape == expected.shape == (len(keys), 3, 32, 32)
        assert torch.equal(batch["label"], torch.tensor([plain[k]["label"] for k in keys]))
        # Normalized pixels (std ~0.22): the decoders may differ by a level or two of 255 here and there.
        assert (batch["image"] - expected).abs().mean() < 0.01
        assert (batch["image"] - expected).abs().max() < 0.2


def test_device_decoding_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="needs JPEG files and no mixup"):
        datasets(tmp_path, "device", mixup_alpha=0.8)
    with pytest.raises(ConfigCompositionException, match="data.decode_on=gpu") as refused:  # while composing
        compose_config("vit_sanity", ["checkpoint.path=unused", "data.decode_on=gpu"])
    assert "expected one of [workers, device]" in str(refused.value.__cause__)
    digits = REPO / "data" / "digits"  # PNG files
    train = build_image_datasets(ImageDataConfig(format="imagefolder", root=str(digits), num_classes=10,
                                                 decode_on="device"), ViTModelConfig(img_size=32, num_classes=10), seed=0)[0]
    with pytest.raises(ValueError, match="decodes JPEG files only"):
        train[0]


@pytest.mark.slow
def test_training_with_device_decoding_runs_end_to_end(tmp_path):
    root = write_jpeg_folder(tmp_path / "jpegs", per_class=4)
    cmd = [sys.executable, str(REPO / "train.py"), "--config-name", "vit_sanity", "data=imagefolder",
           f"data.root={root}", "data.num_classes=2", "data.decode_on=device", "data.num_workers=1",
           "training.steps=3", "training.micro_batch_size=2", "training.global_batch_size=4",
           "training.log_every_n_steps=1", f"hydra.run.dir={tmp_path}/run", f"checkpoint.path={tmp_path}/ckpt",
           "logger.progress_bar=never"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_records(tmp_path / "run")
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3]
    assert any(r.get("split") == "val" and r["top1"] >= 0 for r in rows)
