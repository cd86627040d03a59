"""recipes/vit/image_header.py: a JPEG whose header claims more pixels than its file can hold (truncated or
crafted: decoders fill the missing rows with grey, in silence), and a file far longer than its pixels need (sparse,
padded), are refused before anything is read whole or decoded, on every path that reads images; the densest
JPEGs an image library writes pass."""

from __future__ import annotations

import io
import logging
import os
import struct

import numpy as np
import pytest
from PIL import Image, ImageFile

from core.config.errors import DataError
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, split_files
from recipes.vit.image_header import BYTES_BESIDE_PIXELS, JPEG_PIXELS_PER_BYTE, size_problem

CLAIM = (9000, 9000)  # under PIL's decompression-bomb limit: PIL alone would decode it to 243 MB of grey


def jpeg(img: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", **options)
    return out.getvalue()


def crafted_jpeg(height: int, width: int) -> bytes:
    """A 16 x 16 baseline JPEG whose frame header (SOF0) says height x width: a few hundred bytes."""
    data = bytearray(jpeg(Image.new("RGB", (16, 16), (90, 160, 30)), quality=90))
    frame = data.index(b"\xff\xc0")
    data[frame + 5 : frame + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def header_verdict(data: bytes, file_bytes: int | None = None):
    with Image.open(io.BytesIO(data)) as img:
        return size_problem(img, len(data) if file_bytes is None else file_bytes)


def test_the_densest_jpegs_a_library_writes_pass_and_a_crafted_header_does_not():
    flat_grey, flat_rgb = Image.new("L", (4000, 3000), 128), Image.new("RGB", (4000, 3000), (90, 160, 30))
    densest = [
        jpeg(flat_grey, quality=1, optimize=True, progressive=True),
        jpeg(flat_grey, quality=1, optimize=True),
        jpeg(flat_rgb, quality=1, optimize=True),
    ]
    for data in densest:
        assert header_verdict(data) is None
    # The bound is half of what the densest one takes (two bits a block: its DC code and end of block).
    assert 4000 * 3000 / len(densest[0]) > JPEG_PIXELS_PER_BYTE / 2.2
    small = crafted_jpeg(*CLAIM)
    assert header_verdict(small) == (
        f"its header claims 9000 x 9000 pixels, more than a JPEG file of {len(small):,} bytes holds (at most "
        f"{JPEG_PIXELS_PER_BYTE * len(small):,}: one bit for each 8 x 8 block); it is truncated or crafted, and "
        "would decode to filler"
    )
    assert header_verdict(crafted_jpeg(16, 16)) is None
    # Why the check: PIL decodes such a file to its claimed size, filling what is missing, without an error.
    with Image.open(io.BytesIO(crafted_jpeg(64, 4096))) as img:
        assert np.asarray(img.convert("RGB")).shape == (64, 4096, 3)
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, "PNG")
    assert header_verdict(png.getvalue()) is None  # other formats: PIL refuses a truncated one itself


def test_a_file_far_longer_than_its_pixels_need_is_refused_whatever_its_format():
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, "PNG")
    most = BYTES_BESIDE_PIXELS + 8 * 16 * 16
    assert header_verdict(png.getvalue(), most) is None
    assert header_verdict(png.getvalue(), most + 1) == (
        f"it is {most + 1:,} bytes long, more than an image of 16 x 16 pixels needs (at most {most:,}): padded, "
        "sparse or crafted, or an animation or stack of pages (training reads one frame: keep that one)"
    )
    assert header_verdict(jpeg(Image.new("RGB", (16, 16))), most + 1).startswith(f"it is {most + 1:,} bytes long")


def _folder_with_a_crafted_jpeg(root):
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(2):
                (root / split / c / f"{i}.jpg").write_bytes(jpeg(Image.new("RGB", (40, 30), (40 * i, 90, 30))))
    crafted = root / "train" / "b" / "crafted.jpg"
    crafted.write_bytes(crafted_jpeg(*CLAIM))
    return crafted


def _sparse(crafted):
    """The crafted file replaced by a good 16 x 16 JPEG made sparse: 80 MiB long, a few KiB on disk (what a
    crafted tar member unpacks to)."""
    crafted.write_bytes(jpeg(Image.new("RGB", (16, 16), (200, 10, 10))))
    os.truncate(crafted, BYTES_BESIDE_PIXELS + 16 * 2**20)
    return "it is 83,886,080 bytes long, more than an image of 16 x 16 pixels needs"


@pytest.mark.parametrize("kind", ["claims", "sparse"])
def test_a_folder_listing_leaves_a_crafted_file_out_saying_why(tmp_path, caplog, kind):
    crafted = _folder_with_a_crafted_jpeg(tmp_path / "jpegs")
    says = "its header claims 9000 x 9000" if kind == "claims" else _sparse(crafted)
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path / "jpegs"))
    with caplog.at_level(logging.WARNING):
        files = split_files(data, "train", ["a", "b"])
    assert len(files) == 4 and str(crafted) not in [path for path, _ in files]
    assert f"left out 1 of 5 image files that cannot be read: {crafted} ({says}" in caplog.text


@pytest.mark.parametrize("kind", ["claims", "sparse"])
@pytest.mark.parametrize("decode_on", ["workers", "device"])
def test_a_crafted_file_stops_a_run_naming_it_before_it_is_decoded(tmp_path, monkeypatch, decode_on, kind):
    crafted = _folder_with_a_crafted_jpeg(tmp_path / "jpegs")
    says = "its header claims 9000 x 9000 pix" if kind == "claims" else _sparse(crafted)
    data = ImageDataConfig(
        format="imagefolder", root=str(tmp_path / "jpegs"), num_classes=2, verify_images=False, decode_on=decode_on
    )
    train = build_image_datasets(data, ViTModelConfig(img_size=16, patch_size=4, num_classes=2), seed=0)[0]
    position = [path for path, _ in train.files].index(str(crafted))
    train[0]  # a good file decodes
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or pytest.fail("decoded"))
    with pytest.raises(DataError, match=rf"cannot decode the image {crafted} \({says}"):
        train[position]
    assert decoded == []
