"""An image file's size against the pixels its header claims, compared before anything is read in full or decoded.

Two ways a small or cheap file costs gigabytes:
  * A JPEG decoder fills the rows a file lacks with grey and goes on (PIL, nvImageCodec and DALI alike,
    whenever the file still ends with an end-of-image marker), so a file of a few hundred bytes whose header
    claims 9000 x 9000 pixels decodes to a quarter of a gigabyte of filler each time it is read: in every loader
    worker, and in one batch on the GPU. A Huffman-coded JPEG (what cameras, browsers and image libraries write)
    spends at least one bit on each 8 x 8 block of its largest component, the code of the block's DC value, so
    it holds at most 512 pixels per byte of the file; a header that claims more belongs to a truncated or
    crafted file. (An arithmetic-coded JPEG could compress a nearly blank image further; such a file is refused
    too, and re-encoding it, e.g. with PIL, makes it usable.) PIL refuses other formats' truncated files itself.
  * A file far longer than its pixels need: a sparse file (a 227-byte .tar.gz unpacks to a 10 GiB one that
    takes 4 KiB of disk) or padding would be read whole into a loader worker's memory. No format PIL reads
    spends more than 8 bytes on a pixel (16-bit RGBA, uncompressed); 64 MiB beside that leave room for
    metadata and previews. An animation or a stack of pages longer than that is refused too: training reads
    its first frame only.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Optional

from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile

from core.config.file_shape import open_regular_file

# What PIL raises for a file whose header or pixels it cannot read (truncated, damaged, not an image).
DECODE_ERRORS = (OSError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)
JPEG_PIXELS_PER_BYTE = 512  # eight 8 x 8 blocks of 64 pixels per byte, at one bit a block
MOST_BYTES_PER_PIXEL = 8
BYTES_BESIDE_PIXELS = 64 * 2**20


class NotAnImageFile(ValueError):
    """The file's header cannot be read, or does not fit the file's size; the message says why."""


def size_problem(img: Image.Image, file_bytes: int) -> Optional[str]:
    """Why the pixels the header of `img` (opened, not yet decoded) claims and its file's `file_bytes` do not fit
    together; None when they do."""
    most_bytes = BYTES_BESIDE_PIXELS + MOST_BYTES_PER_PIXEL * img.width * img.height
    if file_bytes > most_bytes:
        return (
            f"it is {file_bytes:,} bytes long, more than an image of {img.width} x {img.height} pixels needs (at "
            f"most {most_bytes:,}): padded, sparse or crafted, or an animation or stack of pages (training reads "
            "one frame: keep that one)"
        )
    most_pixels = JPEG_PIXELS_PER_BYTE * file_bytes
    if isinstance(img, JpegImageFile) and img.width * img.height > most_pixels:
        return (
            f"its header claims {img.width} x {img.height} pixels, more than a JPEG file of {file_bytes:,} bytes "
            f"holds (at most {most_pixels:,}: one bit for each 8 x 8 block); it is truncated or crafted, and would "
            "decode to filler"
        )
    return None


def header_problem(f: BinaryIO) -> Optional[str]:
    """Why the open image file `f` cannot be used, from its header and size alone; None if it can. Leaves `f` at
    its start."""
    try:
        with Image.open(f) as img:  # parses the header only
            return size_problem(img, os.fstat(f.fileno()).st_size)
    except DECODE_ERRORS as e:
        return f"{type(e).__name__}: {e}"
    finally:
        f.seek(0)


def read_image_file(path: str | Path) -> bytes:
    """The bytes of the image file at `path` (links followed), read once its header and size fit together.
    NotAnImageFile when they do not; NotThisKindOfFile for a FIFO, a device or a directory (never waited on);
    other OSErrors as `open` raises them."""
    with open_regular_file(path, follow_symlinks=True) as f:
        problem = header_problem(f)
        if problem is not None:
            raise NotAnImageFile(problem)
        return f.read()
