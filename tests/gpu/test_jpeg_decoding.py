"""JPEG decoding on the GPU (data.decode_on=device, recipes/vit/jpeg.py) against the CPU path (PIL in the
loader workers): the same images up to the JPEG decoders' rounding, damaged files named, and a training run
that decodes on the GPU beside its CUDA-graphed steps."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from core.data.datasets import EpochIndex
from recipes.vit.config import IMAGENET_STD, ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, collate_encoded, decode_batch, encoded_files
from scripts.make_jpeg_imagefolder import write_image
from tests.support.helpers import REPO, read_records

pytestmark = pytest.mark.gpu
# GPU and CPU JPEG decoders round the inverse DCT and the chroma upsampling differently: a few levels of 255
# at a pixel, rarely; the resize in float adds one more.
MAX_LEVELS, MEAN_LEVELS = 6, 0.3
# DALI's hardware decode upsamples chroma more simply than libjpeg-turbo (jpeg_fancy_upsampling=False, for speed):
# colour edges differ more (measured on an H200: 12.9 levels at most, 0.71 on average).
DALI_MAX_LEVELS, DALI_MEAN_LEVELS = 16, 1.0


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """ImageNet-sized JPEGs in two classes, with a progressive, a CMYK and a grayscale one among them (the
    hardware engines take baseline JPEGs only: the others go to the fallback)."""
    root = tmp_path_factory.mktemp("jpegs")
    for split, count in (("train", 24), ("val", 8)):
        for i in range(count):
            folder = root / split / f"class{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            write_image((folder / f"{i:03d}.jpg", 1000 * len(split) + i, 90))
    first = root / "train" / "class0" / "000.jpg"
    with Image.open(first) as img:
        img.save(root / "train" / "class1" / "progressive.jpg", quality=90, progressive=True)
        img.convert("CMYK").save(root / "train" / "class0" / "cmyk.jpg", quality=90)
        img.convert("L").save(root / "train" / "class1" / "gray.jpg", quality=90)
    return root


def datasets(root, decode_on, **kw):
    data = ImageDataConfig(format="imagefolder", root=str(root), num_classes=2, decode_on=decode_on, **kw)
    return build_image_datasets(data, ViTModelConfig(img_size=224, num_classes=2), seed=3)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("backend", ["auto", "cuda", "dali"])
def test_gpu_decoding_gives_the_cpu_paths_images(jpegs, backend):
    from recipes.vit.dali_crops import dali_crops
    from recipes.vit.jpeg import decoder_for

    device = torch.device("cuda")
    for split in (0, 1):  # train (random crops and flips), val (resize + centre crop)
        plain, encoded = datasets(jpegs, "workers")[split], datasets(jpegs, "device")[split]
        keys = [EpochIndex(e, i) for e in (0, 1) for i in range(len(plain))]
        encoded_batch = collate_encoded([encoded[k] for k in keys])
        if backend == "dali" and split == 0:  # DALI's pipeline takes the whole training batch, special files too
            files, t = encoded_files(encoded_batch), encoded.transform
            assert dali_crops(files, encoded_batch["crop"].tolist(), t.size, t.mean, t.std, device) is not None
        batch = decode_batch(encoded_batch, encoded.transform, device, backend)
        expected = plain.transform.normalize(torch.stack([plain[k]["image"] for k in keys]))
        assert batch["image"].device.type == "cuda" and batch["image"].shape == expected.shape
        assert torch.equal(batch["label"].cpu(), torch.tensor([plain[k]["label"] for k in keys]))
        levels = (batch["image"].cpu() - expected).abs() * 255 * min(IMAGENET_STD)
        dali = backend == "dali" and split == 0
        most, mean = (DALI_MAX_LEVELS, DALI_MEAN_LEVELS) if dali else (MAX_LEVELS, MEAN_LEVELS)
        assert levels.max() <= most and levels.mean() < mean, (levels.max(), levels.mean())
    name = torch.cuda.get_device_name()
    if backend == "auto" and any(gpu in name for gpu in ("A100", "H100", "H200")):
        assert decoder_for(device, "auto").backend == "hardware", name  # these GPUs have JPEG engines


def test_gpu_decoding_names_a_damaged_file(jpegs, tmp_path):
    for damage in ("truncated", "garbage"):
        root = tmp_path / damage
        shutil.copytree(jpegs, root)
        bad = root / "train" / "class1" / "005.jpg"
        raw = bad.read_bytes()
        bad.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else raw[:400] + bytes(range(256)) * 64)
        train = datasets(root, "device", verify_images=False)[0]
        with pytest.raises(ValueError, match=f"cannot decode the image {bad}"):
            decode_batch(collate_encoded([train[i] for i in range(len(train))]), train.transform, torch.device("cuda"))


def test_training_decodes_on_the_gpu_beside_graphed_steps(jpegs, tmp_path):
    """The shipped ViT config (CUDA graphs on one GPU) trained from the JPEG folder with the GPU decoder and
    with PIL in the workers: the same batches, so close losses (not equal: the decoders round differently)."""
    losses = {}
    for decode_on in ("device", "workers"):
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            "--config-name",
            "vit_base_patch16_224",
            "data=imagefolder",
            f"data.root={jpegs}",
            "data.num_classes=2",
            f"data.decode_on={decode_on}",
            "data.num_workers=2",
            "model.depth=2",
            "training.steps=4",
            "training.micro_batch_size=4",
            "training.global_batch_size=8",
            "training.log_every_n_steps=1",
            "training.val_every_n_steps=0",
            "training.val_at_end=false",
            "checkpoint.save_final=false",
            f"hydra.run.dir={tmp_path}/{decode_on}",
            f"checkpoint.path={tmp_path}/{decode_on}_ckpt",
            "logger.progress_bar=never",
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = read_records(tmp_path / decode_on)
        losses[decode_on] = np.array([r["loss"] for r in rows if "split" not in r])
    assert len(losses["device"]) == 4 and np.isfinite(losses["device"]).all()
    # The first step's loss is the same weights on the same batch: only the decoders' rounding differs. Later
    # steps drift further (a pixel's rounding changes the update, and the next loss), but a batch out of order
    # or mislabeled would be a different loss altogether.
    np.testing.assert_allclose(losses["device"][0], losses["workers"][0], rtol=3e-3)
    np.testing.assert_allclose(losses["device"], losses["workers"], rtol=6e-2)
