"""JSON Lines files as users hand them in: one JSON value per line, read a line at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from core.config.errors import DataError
from core.data.text_lines import bounded_lines

MAX_LINE_BYTES = 64 << 20  # a long conversation is a few MB; a file with no line end stops here, not at its end


def json_lines(path: Path, source: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line (a byte-order mark on the first is allowed). A line that
    is not UTF-8, not JSON, nested too deeply for the parser or holding an integer longer than Python converts
    (sys.get_int_max_str_digits) or longer than MAX_LINE_BYTES is a DataError naming `source` and the line."""

    def too_long(number: int) -> DataError:
        return DataError(f"{source}: line {number} is longer than {MAX_LINE_BYTES >> 20} MiB (no line end?)")

    with open(path, "rb") as f:
        for number, raw in enumerate(bounded_lines(f, MAX_LINE_BYTES, too_long), start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{source}: line {number} is not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{source}: line {number} is not JSON ({e.msg})") from None
            except ValueError as e:  # an integer of thousands of digits, which int() refuses to convert
                raise DataError(f"{source}: line {number} is not JSON Python reads ({str(e).split(';')[0]})") from None
            except RecursionError:  # a few KB of nested brackets: refused, not a traceback
                raise DataError(f"{source}: line {number} nests its JSON too deeply") from None
            yield number, value
