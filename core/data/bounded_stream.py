"""A decompressing reader held to a bound on what it yields: a compressed text file of a few KB (bz2, xz and zstd
code a repeated line in almost nothing) can expand to gigabytes of well-formed lines, which a bound on each line
does not stop (core/data/text_lines.py)."""

from __future__ import annotations

import io
from typing import IO, Callable


class BoundedReader(io.RawIOBase):
    """The bytes of `stream` (a binary file object), raising too_much() once more than `limit` have been read (at most
    a buffer past it)."""

    def __init__(self, stream: IO[bytes], limit: int, too_much: Callable[[], Exception]):
        self.stream, self.limit, self.too_much, self.read_so_far = stream, limit, too_much, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        self.read_so_far += len(data)
        if self.read_so_far > self.limit:
            raise self.too_much()
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.stream.close()
        super().close()
