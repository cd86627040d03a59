"""data.decode_on=device: the loader workers read JPEG bytes and draw the augmentation; the training device
decodes (nvImageCodec: recipes/vit/jpeg.py) and transforms. Same crops, flips and labels as decoding in the
workers (here the "device" is the CPU: nvImageCodec's libjpeg-turbo decoder, as PIL's; the GPU decoders are
checked in tests/gpu/test_jpeg_decoding.py)."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra.errors import ConfigCompositionException
from PIL import Image

from core.config.errors import ConfigError
from core.data.datasets import EpochIndex
from recipes.vit.config import IMAGENET_STD, ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, collate_encoded, decode_batch, encoded_files
from recipes.vit.jpeg import JpegDecoder, ends_whole
from tests.support.helpers import REPO, compose_config, read_records

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
        expected = plain.transform.normalize(torch.stack([plain[k]["image"] for k in keys]))
        assert batch["image"].shape == expected.shape == (len(keys), 3, 32, 32)
        assert torch.equal(batch["label"], torch.tensor([plain[k]["label"] for k in keys]))
        assert sorted(batch) == ["idx", "image", "label"]
        # The same decoded pixels; resized in float and rounded, against torchvision's uint8 resize: at most
        # one level of 255 apart (normalized: 1 / 255 / std), and most pixels equal.
        diff = (batch["image"] - expected).abs()
        assert diff.max() <= 1 / 255 / min(IMAGENET_STD) + 1e-5
        assert diff.mean() < 0.005 and (diff > 1e-5).float().mean() < 0.3


def jpeg_bytes(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def test_the_decoder_gives_pil_pixels_for_every_kind_of_jpeg():
    """Grayscale, CMYK and progressive JPEGs too (found in real data sets), decoded as PIL's convert("RGB")."""
    rng = np.random.default_rng(1)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3)).astype(np.uint8))
    files = [
        jpeg_bytes(rgb),
        jpeg_bytes(rgb.convert("L")),
        jpeg_bytes(rgb.convert("CMYK")),
        jpeg_bytes(rgb, progressive=True),
        jpeg_bytes(rgb, subsampling=0),
    ]
    decoded = JpegDecoder(torch.device("cpu")).decode(
        [np.frombuffer(f, np.uint8) for f in files], [f"f{i}.jpg" for i in range(len(files))], [(37, 53)] * len(files)
    )
    for raw, image in zip(files, decoded):
        with Image.open(io.BytesIO(raw)) as img:
            expected = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)
        assert image.dtype == torch.uint8 and torch.equal(image, expected)


def test_a_file_the_decoder_cannot_read_is_named(tmp_path):
    good = jpeg_bytes(Image.new("RGB", (30, 20), (10, 200, 30)))
    cases = {
        "truncated.jpg": good[: len(good) // 2],
        "garbage.jpg": good[:200] + bytes(range(256)) * 4,
        "no_header.jpg": b"\xff\xd8" + bytes(50),
    }
    assert ends_whole(np.frombuffer(good, np.uint8)) and not ends_whole(np.frombuffer(cases["truncated.jpg"], np.uint8))
    decoder = JpegDecoder(torch.device("cpu"))
    for name, raw in cases.items():
        with pytest.raises(ValueError, match=f"cannot decode the image dir/{name}"):
            decoder.decode(
                [np.frombuffer(good, np.uint8), np.frombuffer(raw, np.uint8)],
                ["dir/ok.jpg", f"dir/{name}"],
                [(20, 30), (20, 30)],
            )
    # A header that reads otherwise than it did to PIL in the loader worker (whose checks bound the size).
    with pytest.raises(ValueError, match="dir/ok.jpg: its header reads 20 x 31 pixels to PIL and 20 x 30"):
        decoder.decode([np.frombuffer(good, np.uint8)], ["dir/ok.jpg"], [(20, 31)])
    # Through the dataset and the batch, as the loop decodes: the file's path in the message.
    root = write_jpeg_folder(tmp_path / "jpegs")
    bad = root / "train" / "class1" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:300] + bytes(range(256)) * 8)
    train = datasets(root, "device", verify_images=False)[0]
    with pytest.raises(ValueError, match=f"cannot decode the image {bad}"):
        decode_batch(collate_encoded([train[i] for i in range(len(train))]), train.transform, torch.device("cpu"))


def test_device_decoding_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="needs JPEG files and no mixup"):
        datasets(tmp_path, "device", mixup_alpha=0.8)
    with pytest.raises(ConfigCompositionException, match="data.decode_on=gpu") as refused:  # while composing
        compose_config("vit_sanity", ["checkpoint.path=unused", "data.decode_on=gpu"])
    assert "expected one of [workers, device]" in str(refused.value.__cause__)
    digits = REPO / "data" / "digits"  # PNG files
    train = build_image_datasets(
        ImageDataConfig(format="imagefolder", root=str(digits), num_classes=10, decode_on="device"),
        ViTModelConfig(img_size=32, num_classes=10),
        seed=0,
    )[0]
    with pytest.raises(ValueError, match="decodes JPEG files only"):
        train[0]


@pytest.mark.slow
def test_training_with_device_decoding_runs_end_to_end(tmp_path):
    root = write_jpeg_folder(tmp_path / "jpegs", per_class=4)
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "--config-name",
        "vit_sanity",
        "data=imagefolder",
        f"data.root={root}",
        "data.num_classes=2",
        "data.decode_on=device",
        "data.num_workers=1",
        "training.steps=3",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.log_every_n_steps=1",
        f"hydra.run.dir={tmp_path}/run",
        f"checkpoint.path={tmp_path}/ckpt",
        "logger.progress_bar=never",
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32: the recipe queues GPU work beside the step" in proc.stderr + proc.stdout
    rows = read_records(tmp_path / "run")
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3]
    assert any(r.get("split") == "val" and r["top1"] >= 0 for r in rows)


KERNEL_CHECK = """
import sys
import torch
from recipes.vit.config import ImageDataConfig
from recipes.vit.data import Transform
from recipes.vit.crop_resize import crop_resize_normalize
g = torch.Generator().manual_seed(0)
sizes = [(40, 56), (64, 48), (33, 33), (120, 80), (200, 90), (31, 100), (24, 24)]
images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
for train in (True, False):
    transform = Transform(ImageDataConfig(), 24, train=train)
    crops = [transform.draw(h, w, torch.Generator().manual_seed(i)) for i, (h, w) in enumerate(sizes)]
    reference = crop_resize_normalize(images, crops, transform, use_kernel=False)
    levels = (crop_resize_normalize(images, crops, transform, use_kernel=True) - reference).abs() * 255 * 0.225
    print(train, levels.max().item(), (levels > 1e-3).float().mean().item())
"""


@pytest.mark.slow
def test_the_gpu_crop_kernel_gives_the_torch_paths_pixels():
    """The Triton kernel that crops, resizes (antialiased), flips and normalizes a GPU batch, run by Triton's
    interpreter on the CPU against torch's image-by-image path: the same pixels but for a rare level of 255
    where the two sum the filter's taps in another order and round to the other side."""
    pytest.importorskip("triton", reason="Triton comes with CUDA builds of torch only")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [row[0] for row in rows] == ["True", "False"]
    for _, max_levels, share in rows:
        assert float(max_levels) <= 1.01 and float(share) < 0.01, rows


def test_a_run_decoding_on_the_device_asks_for_more_cuda_queues_before_cuda_starts(monkeypatch, caplog):
    """The decoder's streams get hardware queues of their own (CUDA_DEVICE_MAX_CONNECTIONS, read once when the
    CUDA context starts): session.start sets it from the recipe unless the user did, and says when it cannot."""
    from core import runtime
    from recipes.vit.jpeg import CUDA_CONNECTIONS
    from recipes.vit.recipe import ViTRecipe

    on_device = compose_config("vit_sanity", ["data=imagefolder", "data.root=/unused", "data.decode_on=device"])
    assert ViTRecipe(on_device).cuda_connections() == CUDA_CONNECTIONS
    assert ViTRecipe(compose_config("vit_sanity", [])).cuda_connections() is None

    monkeypatch.delenv(runtime.CUDA_CONNECTIONS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)  # rank 0, or a plain process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    runtime.request_cuda_connections(None)
    assert runtime.CUDA_CONNECTIONS_ENV not in os.environ
    runtime.request_cuda_connections(CUDA_CONNECTIONS)
    assert os.environ[runtime.CUDA_CONNECTIONS_ENV] == str(CUDA_CONNECTIONS)

    caplog.set_level("WARNING")
    cases = (("8", True), ("1", True), ("32", False), (" 32 ", False), ("64", False), ("many", True), ("\u00b2", True))
    for given, warned in cases:
        caplog.clear()
        monkeypatch.setenv(runtime.CUDA_CONNECTIONS_ENV, given)
        runtime.request_cuda_connections(CUDA_CONNECTIONS)
        assert os.environ[runtime.CUDA_CONNECTIONS_ENV] == given  # the user's value wins
        assert (runtime.CUDA_CONNECTIONS_ENV in caplog.text) == warned, given

    caplog.clear()
    monkeypatch.delenv(runtime.CUDA_CONNECTIONS_ENV)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    runtime.request_cuda_connections(CUDA_CONNECTIONS)
    assert runtime.CUDA_CONNECTIONS_ENV not in os.environ
    assert "CUDA started before" in caplog.text
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # the other ranks stay quiet: rank 0 says it for all
    runtime.request_cuda_connections(CUDA_CONNECTIONS)
    assert caplog.text == ""


# ---- data.device_decoder=dali (recipes/vit/dali_crops.py); here DALI's CPU pipeline (libjpeg-turbo)


@pytest.fixture(autouse=True)
def _dali_pipelines_released():
    """The pipelines this thread built go when a test ends: their thread pools would outlive it in every later
    test of the session (and in any process forked from it)."""
    yield
    from recipes.vit import dali_crops

    dali_crops._per_thread.__dict__.pop("pipelines", None)
    gc.collect()


def test_dali_gives_the_workers_training_crops_and_leaves_validation_to_nvimgcodec(tmp_path):
    from recipes.vit.dali_crops import dali_crops

    root = write_jpeg_folder(tmp_path / "jpegs")
    for split in (0, 1):
        plain, encoded = datasets(root, "workers")[split], datasets(root, "device", device_decoder="dali")[split]
        keys = [EpochIndex(e, i) for e in (0, 1, 2) for i in range(len(plain))]
        batch = collate_encoded([encoded[k] for k in keys])
        t = encoded.transform
        by_dali = dali_crops(encoded_files(batch), batch["crop"].tolist(), t.size, t.mean, t.std, torch.device("cpu"))
        assert (by_dali is None) == (split == 1)  # validation geometry: the nvImageCodec path
        decoded = decode_batch(batch, t, torch.device("cpu"), "dali")
        if by_dali is not None:
            assert torch.equal(decoded["image"], by_dali)
        expected = plain.transform.normalize(torch.stack([plain[k]["image"] for k in keys]))
        assert decoded["image"].shape == expected.shape == (len(keys), 3, 32, 32)
        assert torch.equal(decoded["label"], torch.tensor([plain[k]["label"] for k in keys]))
        # DALI's antialiased resize against torchvision's: a level of 255 apart at most, on average a seventh.
        levels = (decoded["image"] - expected).abs() * 255 * min(IMAGENET_STD)
        assert levels.max() <= 1.01 and levels.mean() < 0.2, (levels.max(), levels.mean())


def test_dali_hands_special_files_to_nvimgcodec_which_names_a_bad_one(tmp_path, monkeypatch):
    from recipes.vit.dali_crops import DaliCrops, dali_crops

    built = []
    build = DaliCrops.__init__
    monkeypatch.setattr(DaliCrops, "__init__", lambda self, *args: (built.append(args[1]), build(self, *args))[1])

    root = write_jpeg_folder(tmp_path / "jpegs")
    train = datasets(root, "device", device_decoder="dali", verify_images=False)[0]
    t, cpu = train.transform, torch.device("cpu")
    good = np.frombuffer(jpeg_bytes(Image.new("RGB", (30, 20), (10, 200, 30))), np.uint8)
    crop = [[2, 3, 10, 12, 0]]
    assert dali_crops([good], crop, t.size, t.mean, t.std, cpu) is not None
    assert dali_crops([good[: len(good) // 2]], crop, t.size, t.mean, t.std, cpu) is None  # no end-of-image marker
    # Followed by much other data: decodable, but a GPU decoder would not tell a truncated file like it.
    assert dali_crops([np.concatenate([good, np.zeros(2048, np.uint8)])], crop, t.size, t.mean, t.std, cpu) is None
    garbage = np.frombuffer(good.tobytes()[:200] + bytes(range(256)) * 4 + b"\xff\xd9", np.uint8)
    assert dali_crops([good, garbage], crop * 2, t.size, t.mean, t.std, cpu) is None  # refused by DALI
    assert dali_crops([good, good], crop * 2, t.size, t.mean, t.std, cpu) is not None  # the next batch decodes again
    assert built == [1, 2, 2]  # on a pipeline built anew after the refusal
    bad = root / "train" / "class1" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:300] + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=f"cannot decode the image {bad}"):
        decode_batch(collate_encoded([train[i] for i in range(len(train))]), t, cpu, "dali")
    # A header that reads larger to the GPU decoder than to PIL is refused before DALI allocates anything.
    batch = collate_encoded([train[0]])
    batch["size"] = torch.tensor([[batch["size"][0, 0] + 1, batch["size"][0, 1]]])
    with pytest.raises(ValueError, match="its header reads .* to PIL and .* to nvImageCodec"):
        decode_batch(batch, t, cpu, "dali")


def test_a_missing_dali_is_named_before_any_work(tmp_path, monkeypatch):
    root = write_jpeg_folder(tmp_path / "jpegs")
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(ImportError, match="data.device_decoder=dali decodes with NVIDIA DALI: pip install"):
        datasets(root, "device", device_decoder="dali")
