"""What is wrong with a file that does not have the shape its reader expects, field by field.

The files this tool reads back (LOCK, run.json, a Hugging Face config.json, ...) are checked against pydantic
models; a `ValidationError` becomes one line for the user's message: `pid='abc': Input should be a valid
integer; host missing`. Before that, `read_small_file` makes sure the name is a small regular file at all:
a FIFO, a device, a directory or a link to one would otherwise hang the reader or fill its memory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError


class NotThisKindOfFile(ValueError):
    """The name is there, but is not a small regular file (the message says what it is instead)."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular_file(path: str | Path, follow_symlinks: bool = False) -> BinaryIO:
    """`path` opened for reading in binary, without blocking: NotThisKindOfFile when it is not a regular file (a
    FIFO, whose opening would wait for a writer forever, a device, a directory, a socket) or, unless
    `follow_symlinks`, a symbolic link. FileNotFoundError and other OSErrors as `open` raises them."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # O_NONBLOCK: opening a FIFO does not wait
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:  # O_NOFOLLOW met a link (or a loop of links)
            raise NotThisKindOfFile("it is a symbolic link, not followed: a file of this kind never is one") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotThisKindOfFile(f"it is {kind}, not a regular file")
        return os.fdopen(fd, "rb")  # a regular file's reads ignore O_NONBLOCK
    except BaseException:
        os.close(fd)
        raise


def read_small_file_and_stat(
    path: str | Path, max_bytes: int, follow_symlinks: bool = False
) -> tuple[bytes, os.stat_result]:
    """`read_small_file`, with the file's fstat (device, inode, mtime of exactly the file read)."""
    with open_regular_file(path, follow_symlinks) as f:
        status = os.fstat(f.fileno())
        content = f.read(max_bytes + 1)  # one byte more than max_bytes tells a file that is too large
    if len(content) > max_bytes:
        raise NotThisKindOfFile(f"it is larger than {max_bytes} bytes, far more than a file of this kind holds")
    return content, status


def read_small_file(path: str | Path, max_bytes: int, follow_symlinks: bool = False) -> bytes:
    """The bytes of a small regular file, read without blocking and at most `max_bytes` of them.

    NotThisKindOfFile (a ValueError; its message reads after the file's name: `<path>: it is a FIFO, ...`)
    when `path` is a directory, FIFO, device or socket, is larger than `max_bytes`, or, unless
    `follow_symlinks`, is a symbolic link (even to a regular file). FileNotFoundError and other OSErrors
    (permission denied, ...) as `open` raises them."""
    return read_small_file_and_stat(path, max_bytes, follow_symlinks)[0]


def shown(value: Any) -> str:
    """A value from the file, for a message: cut short if long."""
    text = repr(value)
    return text if len(text) <= 120 else text[:110] + "..."


def problems(error: ValidationError) -> str:
    """Each field's problem, `key=value: what was expected`, or `key missing`."""
    parts = []
    for e in error.errors(include_url=False):
        key = ".".join(str(part) for part in e["loc"])
        message = e["msg"].removeprefix("Value error, ").split(" or instance of ")[0]
        if e["type"] == "missing" or (key and e["input"] is None):
            parts.append(f"{key} missing" + (" (null)" if e["type"] != "missing" else ""))
        else:
            parts.append(f"{key}={shown(e['input'])}: {message}" if key else message)
    return "; ".join(parts)
