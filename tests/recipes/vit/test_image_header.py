"""recipes/vit/image_header.py: a JPEG whose header claims more pixels than its file can hold (truncated or
crafted: decoders fill the missing rows with grey, in silence), and a file far longer than its pixels need (sparse,
padded), are refused before anything is read whole or decoded, on every path that reads images; the densest
JPEGs an image library writes pass."""

from __future__ import annotations

import io
import logging
import os
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from core.config.errors import DataError
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets, split_files
from recipes.vit.image_header import (
    BYTES_BESIDE_PIXELS,
    HEADER_PREFIXES,
    JPEG_PIXELS_PER_BYTE,
    MOST_FILE_BYTES,
    MOST_PIXELS,
    PNG_PIXELS_PER_BYTE,
    header_problem,
    size_problem,
)

CLAIM = (6000, 6000)  # under the pixel ceiling: only the bound on pixels a byte refuses it


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
        f"its header claims 6000 x 6000 pixels, more than a JPEG file of {len(small):,} bytes holds (at most "
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
    says = "its header claims 6000 x 6000" if kind == "claims" else _sparse(crafted)
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path / "jpegs"))
    with caplog.at_level(logging.WARNING):
        files = split_files(data, "train", ["a", "b"])
    assert len(files) == 4 and str(crafted) not in [path for path, _ in files]
    assert f"left out 1 of 5 image files that cannot be read: {crafted} ({says}" in caplog.text


@pytest.mark.parametrize("kind", ["claims", "sparse"])
@pytest.mark.parametrize("decode_on", ["workers", "device"])
def test_a_crafted_file_stops_a_run_naming_it_before_it_is_decoded(tmp_path, monkeypatch, decode_on, kind):
    crafted = _folder_with_a_crafted_jpeg(tmp_path / "jpegs")
    says = "its header claims 6000 x 6000 pix" if kind == "claims" else _sparse(crafted)
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


def png_claiming(width: int, height: int, mode: str = "1") -> bytes:
    """A 16 x 16 PNG of one colour whose IHDR says width x height (its checksum kept right): a few dozen bytes."""
    out = io.BytesIO()
    Image.new(mode, (16, 16)).save(out, "PNG")
    data = bytearray(out.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(data[12:29]))
    return bytes(data)


def webp_claiming(width: int, height: int) -> bytes:
    """A lossless one-colour WebP whose header says width x height: its pixels cost no bits, so it decodes at
    that size (34 bytes for 9000 x 9000)."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 0, 0)).save(out, "WEBP", lossless=True, quality=0, method=0)
    data = bytearray(out.getvalue())
    bits = struct.unpack("<I", data[21:25])[0] & ~((1 << 28) - 1)
    data[21:25] = struct.pack("<I", bits | (width - 1) | ((height - 1) << 14))
    return bytes(data)


def test_every_format_is_held_to_the_pixel_ceiling_and_a_png_to_its_pixels_a_byte():
    for crafted in (webp_claiming(9000, 9000), png_claiming(9000, 9000, "RGB")):
        assert header_verdict(crafted) == (
            f"its header claims 9000 x 9000 pixels, more than an image may have here (at most {MOST_PIXELS:,}); "
            "every image is decoded whole in a loader worker: shrink it, or leave it out"
        )
    assert header_verdict(webp_claiming(7000, 7000)) is None  # under the ceiling: no bound a byte for WebP
    # A one-colour PNG of one bit a pixel, as compressed as zlib makes it, passes; the same header with less
    # data than deflate can expand to its pixels does not.
    flat = io.BytesIO()
    Image.new("1", (4000, 4000)).save(flat, "PNG", optimize=True)
    assert header_verdict(flat.getvalue()) is None
    small = png_claiming(4000, 4000)
    assert header_verdict(small) == (
        f"its header claims 4000 x 4000 pixels, more than a PNG file of {len(small):,} bytes holds (at most "
        f"{PNG_PIXELS_PER_BYTE * len(small):,}: deflate expands at most 1032-fold, at one bit a pixel); it is "
        "truncated or crafted, and would decode to filler"
    )


def test_a_webp_bomb_is_left_out_of_a_folder_and_stops_a_run_before_it_is_decoded(tmp_path, caplog, monkeypatch):
    crafted = _folder_with_a_crafted_jpeg(tmp_path / "images")
    crafted.unlink()
    bomb = crafted.with_suffix(".webp")
    bomb.write_bytes(webp_claiming(9000, 9000))
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path / "images"), num_classes=2)
    with caplog.at_level(logging.WARNING):
        assert str(bomb) not in [path for path, _ in split_files(data, "train", ["a", "b"])]
    assert f"{bomb} (its header claims 9000 x 9000 pixels, more than an image may have here" in caplog.text
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path / "images"), num_classes=2, verify_images=False)
    train = build_image_datasets(data, ViTModelConfig(img_size=16, patch_size=4, num_classes=2), seed=0)[0]
    position = [path for path, _ in train.files].index(str(bomb))
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded"))
    with pytest.raises(DataError, match=rf"cannot decode the image {bomb} \(its header claims 9000 x 9000"):
        train[position]


def test_running_out_of_memory_while_decoding_is_a_refusal_naming_the_file(tmp_path, monkeypatch):
    _folder_with_a_crafted_jpeg(tmp_path / "jpegs").unlink()
    data = ImageDataConfig(format="imagefolder", root=str(tmp_path / "jpegs"), num_classes=2)
    train = build_image_datasets(data, ViTModelConfig(img_size=16, patch_size=4, num_classes=2), seed=0)[0]

    def out_of_memory(self):
        raise MemoryError()

    monkeypatch.setattr(ImageFile.ImageFile, "load", out_of_memory)
    with pytest.raises(DataError, match=rf"cannot decode the image {train.files[0][0]} \(MemoryError"):
        train[0]


def test_a_header_is_read_from_a_bounded_prefix_and_a_file_too_long_for_any_image_is_refused_first(tmp_path):
    # A JPEG's first bytes and a hole: PIL's parser would step over it a byte at a time.
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"\xff\xd8\xff\xe0")
    os.truncate(junk, 32 * 2**20)
    start = time.process_time()
    with junk.open("rb") as f:
        assert header_problem(f) == f"no image header with its size in the first {HEADER_PREFIXES[-1]:,} bytes"
    assert time.process_time() - start < 1
    # A megabyte of ICC profile before the frame header (APP2 segments) still passes.
    profiled = tmp_path / "profiled.jpg"
    profiled.write_bytes(jpeg(Image.new("RGB", (64, 48), (90, 160, 30)), icc_profile=os.urandom(2**20)))
    with profiled.open("rb") as f:
        assert header_problem(f) is None
    # TIFF and WebP headers are read where they lie: a TIFF's directory at its end, a WebP whole.
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (1200, 1000, 3), dtype=np.uint8))
    for kind, options in (("TIFF", {"compression": "tiff_deflate"}), ("WEBP", {"lossless": True, "method": 0})):
        out = io.BytesIO()
        noise.save(out, kind, **options)
        assert out.tell() > HEADER_PREFIXES[-1] and header_problem(out, out.tell()) is None
    os.truncate(profiled, MOST_FILE_BYTES + 1)  # refused on its length alone, before the header
    with profiled.open("rb") as f:
        assert header_problem(f) == (
            f"it is {MOST_FILE_BYTES + 1:,} bytes long, more than any image file may be here (at most "
            f"{MOST_FILE_BYTES:,})"
        )
