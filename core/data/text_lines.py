"""Lines of a file read with a bound on each: a file with no line end (a sparse file, a decompression bomb, a
stream of NUL bytes) costs at most the bound, not its whole size, before it is refused."""

from __future__ import annotations

from typing import IO, Callable, Iterator, TypeVar

Line = TypeVar("Line", str, bytes)


def bounded_lines(f: IO[Line], limit: int, too_long: Callable[[int], Exception]) -> Iterator[Line]:
    """The lines of `f` (text or binary, line ends kept); raises too_long(line number) for a line of more than
    `limit` characters (bytes) before its line end."""
    number = 0
    while True:
        line = f.readline(limit + 2)  # a line of `limit` characters and its end ("\r\n" at most) fits
        if not line:
            return
        number += 1
        if len(line.rstrip("\r\n" if isinstance(line, str) else b"\r\n")) > limit:
            raise too_long(number)
        yield line
