"""An image file's size against the pixels its header claims, compared before anything is read in full or decoded.

Ways a small or cheap file costs gigabytes, or minutes:
  * Every image is decoded whole, in every loader worker, before the crop shrinks it: at 4 bytes a pixel and again
    for a colour conversion. An image of more than MOST_PIXELS is refused (a 48 MP phone's or a 45 MP camera's
    full-size photo passes; PIL only warns at 89 million and refuses twice that), whatever its format: a lossless
    WebP of one colour holds 9000 x 9000 pixels in a few dozen bytes, a PNG in a few hundred KB.
  * A JPEG decoder fills the rows a file lacks with grey and goes on (PIL, nvImageCodec and DALI alike,
    whenever the file still ends with an end-of-image marker), so a file of a few hundred bytes whose header
    claims 6000 x 6000 pixels decodes to a hundred megabytes of filler each time it is read: in every loader
    worker, and in one batch on the GPU. A Huffman-coded JPEG (what cameras, browsers and image libraries write)
    spends at least one bit on each 8 x 8 block of its largest component, the code of the block's DC value, so
    it holds at most 512 pixels per byte of the file; a header that claims more belongs to a truncated or
    crafted file. (An arithmetic-coded JPEG could compress a nearly blank image further; such a file is refused
    too, and re-encoding it, e.g. with PIL, makes it usable.) A PNG's deflate stream expands at most 1032-fold
    and a PNG spends at least a bit on a pixel, so it holds at most 8 x 1032 pixels a byte: a one-colour
    screenshot comes close, and passes. WebP, GIF, TIFF and BMP can code a flat image of any size in a few dozen
    bytes (skipped blocks, run codes, a background fill), so for them the pixel ceiling is the bound. PIL
    refuses other formats' truncated files itself.
  * A file far longer than its pixels need: a sparse file (a 227-byte .tar.gz unpacks to a 10 GiB one that
    takes 4 KiB of disk) or padding would be read whole into a loader worker's memory. No format PIL reads
    spends more than 8 bytes on a pixel (16-bit RGBA, uncompressed); 64 MiB beside that leave room for
    metadata and previews. An animation or a stack of pages longer than that is refused too: training reads
    its first frame only. No image file may be longer than MOST_FILE_BYTES, checked before its header is read.
  * PIL's JPEG and PPM parsers step over bytes that are not a marker one at a time, in Python: a JPEG's first
    bytes and a long hole cost CPU time in proportion to the hole. The header is parsed from the
    file's first HEADER_PREFIXES bytes (enough for a JPEG's EXIF, ICC profile and thumbnail); one whose size
    is not found there is refused. TIFF and WebP headers are read where they lie (PIL seeks to a TIFF's
    directory, which libtiff writes at the end, and reads a WebP whole: bounded by MOST_FILE_BYTES).
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import BinaryIO, Optional

import numpy as np
from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile
from PIL.PngImagePlugin import PngImageFile

from core.config.file_shape import open_regular_file

# What PIL raises for a file whose header or pixels it cannot read (truncated, damaged, not an image), or whose
# pixels do not fit in memory.
DECODE_ERRORS = (OSError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError, MemoryError)
MOST_PIXELS = 50_000_000
JPEG_PIXELS_PER_BYTE = 512  # eight 8 x 8 blocks of 64 pixels per byte, at one bit a block
PNG_PIXELS_PER_BYTE = 8 * 1032  # deflate's largest expansion, at one bit a pixel
MOST_BYTES_PER_PIXEL = 8
BYTES_BESIDE_PIXELS = 64 * 2**20
MOST_FILE_BYTES = 256 * 2**20  # a ceiling-sized image in 8-bit RGB, uncompressed, with room beside
HEADER_PREFIXES = (64 * 2**10, 2 * 2**20)  # the first holds nearly every header; the second, large APPn segments
_READ_WHERE_THEY_LIE = (b"II*\x00", b"MM\x00*", b"RIFF")  # TIFF (either byte order), WebP


class NotAnImageFile(ValueError):
    """The file's header cannot be read, or does not fit the file's size; the message says why."""


def size_problem(img: Image.Image, file_bytes: int) -> Optional[str]:
    """Why the pixels the header of `img` (opened, not yet decoded) claims and its file's `file_bytes` do not fit
    together; None when they do."""
    pixels = img.width * img.height
    if pixels > MOST_PIXELS:
        return (
            f"its header claims {img.width} x {img.height} pixels, more than an image may have here (at most "
            f"{MOST_PIXELS:,}); every image is decoded whole in a loader worker: shrink it, or leave it out"
        )
    most_bytes = BYTES_BESIDE_PIXELS + MOST_BYTES_PER_PIXEL * pixels
    if file_bytes > most_bytes:
        return (
            f"it is {file_bytes:,} bytes long, more than an image of {img.width} x {img.height} pixels needs (at "
            f"most {most_bytes:,}): padded, sparse or crafted, or an animation or stack of pages (training reads "
            "one frame: keep that one)"
        )
    for kind, name, per_byte, unit in (
        (JpegImageFile, "JPEG", JPEG_PIXELS_PER_BYTE, "one bit for each 8 x 8 block"),
        (PngImageFile, "PNG", PNG_PIXELS_PER_BYTE, "deflate expands at most 1032-fold, at one bit a pixel"),
    ):
        if isinstance(img, kind) and pixels > per_byte * file_bytes:
            return (
                f"its header claims {img.width} x {img.height} pixels, more than a {name} file of {file_bytes:,} "
                f"bytes holds (at most {per_byte * file_bytes:,}: {unit}); it is truncated or crafted, and would "
                "decode to filler"
            )
    return None


def header_problem(f: BinaryIO, file_bytes: Optional[int] = None) -> Optional[str]:
    """Why the open image file `f` (or any seekable binary stream of `file_bytes`) cannot be used, from its
    header and size alone; None if it can. Leaves `f` at its start."""
    if file_bytes is None:
        file_bytes = os.fstat(f.fileno()).st_size
    if file_bytes > MOST_FILE_BYTES:
        return f"it is {file_bytes:,} bytes long, more than any image file may be here (at most {MOST_FILE_BYTES:,})"
    try:
        for limit in HEADER_PREFIXES:
            f.seek(0)
            prefix = f.read(limit)
            source = f if prefix.startswith(_READ_WHERE_THEY_LIE) else io.BytesIO(prefix)
            f.seek(0)
            try:
                img = Image.open(source)  # parses the header only
            except DECODE_ERRORS as e:
                if source is f or len(prefix) == file_bytes:
                    return f"{type(e).__name__}: {e}"
                continue  # perhaps a header longer than the prefix
            with img:
                return size_problem(img, file_bytes)
        return f"no image header with its size in the first {HEADER_PREFIXES[-1]:,} bytes"
    finally:
        f.seek(0)


def rgb(img: Image.Image) -> Image.Image:
    """`img` in 8-bit RGB. A 16-bit grayscale image (a PNG or TIFF of mode I;16) keeps its high byte, as
    torchvision's to_dtype scales uint16 to uint8: PIL's own conversion clips its values to 255, all but black
    becoming white."""
    if img.mode.startswith("I;16"):
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    return img if img.mode == "RGB" else img.convert("RGB")


def read_image_file(path: str | Path) -> bytes:
    """The bytes of the image file at `path` (links followed), read once its header and size fit together.
    NotAnImageFile when they do not; NotThisKindOfFile for a FIFO, a device or a directory (never waited on);
    other OSErrors as `open` raises them."""
    with open_regular_file(path, follow_symlinks=True) as f:
        problem = header_problem(f)
        if problem is not None:
            raise NotAnImageFile(problem)
        return f.read()
