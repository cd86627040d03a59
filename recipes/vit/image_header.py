"""Whether an image file can hold the pixels its header claims, asked before anything is decoded.

A JPEG decoder fills the rows a file lacks with grey and goes on (PIL, nvImageCodec and DALI alike, whenever
the file still ends with an end-of-image marker), so a file of a few hundred bytes whose header claims 9000 x 9000
pixels decodes to a quarter of a gigabyte of filler each time it is read: in every loader worker, and in one batch
on the GPU, where a few such files take the device's memory. A Huffman-coded JPEG (what cameras, browsers and
image libraries write) spends at least one bit on each 8 x 8 block of its largest component, the code of the
block's DC value, so it holds at most 512 pixels per byte of the file; a header that claims more belongs to a
truncated or crafted file. (An arithmetic-coded JPEG could compress a nearly blank image further; such a file is
refused too, and re-encoding it, e.g. with PIL, makes it usable.) Other formats are not bounded here: PIL refuses
a truncated PNG, GIF or TIFF before filling it.
"""

from __future__ import annotations

from typing import Optional

from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile

JPEG_PIXELS_PER_BYTE = 512  # eight 8 x 8 blocks of 64 pixels per byte, at one bit a block


def claims_more_than_it_holds(img: Image.Image, file_bytes: int) -> Optional[str]:
    """Why the header of `img` (opened, not yet decoded) claims more pixels than its file of `file_bytes` bytes
    can hold; None when it does not."""
    most = JPEG_PIXELS_PER_BYTE * file_bytes
    if not isinstance(img, JpegImageFile) or img.width * img.height <= most:
        return None
    return (
        f"its header claims {img.width} x {img.height} pixels, more than a JPEG file of {file_bytes:,} bytes holds "
        f"(at most {most:,}: one bit for each 8 x 8 block); it is truncated or crafted, and would decode to filler"
    )
