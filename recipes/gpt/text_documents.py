"""The documents of a .txt file, read a block at a time (memory: a block, a line and one document, never the file).

The text is UTF-8 (a byte-order mark at the start dropped), with Windows and old Mac line ends read as `\\n`, as
Python's text mode reads them; only these end a line (a form feed or U+2028 inside a line does not). A document
is a paragraph (lines up to a blank line: one of whitespace only), a line, or the whole file, with its line
ends at either end dropped and kept only if it holds more than whitespace. The rule is the one of splitting the
whole text at the regular expression `\\n\\s*\\n` (or `\\n`), read a line at a time: a run of blank lines
separates paragraphs unless it is a single line at the very start or end of the file, which belongs to the
paragraph beside it instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from core.config.errors import DataError
from core.data.json_lines import MAX_LINE_BYTES

TEXT_DOCUMENTS = ("paragraph", "line", "file")

BLOCK_BYTES = 1 << 20  # read at a time; a line longer than this is read whole, up to MAX_LINE_BYTES


def text_lines(path: Path, named: str) -> Iterator[str]:
    """The file's lines L0..Lk without their ends: k line ends, Lk what follows the last (often ""). `named`
    names the file and what gave it in errors; a line longer than MAX_LINE_BYTES is a DataError."""
    start_line, offset, piece = 1, 0, bytearray()
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            end = block.rfind(b"\n") + 1
            if block and end == 0:  # no line end yet: whole lines only, so a \r\n is never cut in two
                piece += block
                if len(piece) > MAX_LINE_BYTES:  # a sparse file, a stream of NULs: refused, not read whole
                    raise DataError(
                        f"{named}:{start_line}: a line longer than {MAX_LINE_BYTES >> 20} MiB (no line end?)"
                    )
                continue
            piece += block[:end] if block else b""
            text = decoded(piece, offset == 0, named, start_line, offset)
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            if not block:
                yield from lines
                return
            yield from lines[:-1]  # the piece ends with a line end: what follows it comes with the next one
            start_line, offset = start_line + piece.count(b"\n"), offset + len(piece)
            piece = bytearray(block[end:])


def decoded(piece: bytearray, at_start: bool, named: str, start_line: int, offset: int) -> str:
    """Whole lines of the file, from its byte `offset` (line `start_line`) on, as text."""
    try:
        return piece.decode("utf-8-sig" if at_start else "utf-8")  # a byte-order mark is no text
    except UnicodeDecodeError as e:
        at = e.start + (3 if at_start and piece.startswith(b"\xef\xbb\xbf") else 0)  # utf-8-sig counts past it
        line = start_line + piece.count(b"\n", 0, at)
        raise DataError(
            f"{named}:{line}: not UTF-8 text (byte {offset + at} of the file: {e.reason}); is it a binary file?"
        ) from None


def blank(line: str) -> bool:
    return not line or line.isspace()  # str.isspace and the regular expression's \s agree on every character


def paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """Lines joined into paragraphs, as splitting their text at `\\n\\s*\\n` would; blank ones included."""
    paragraph: list[str] = []
    run, run_first, run_at_start, first_line = 0, "", False, True  # the blank lines after `paragraph`
    for line in lines:
        if blank(line):
            if run == 0:
                run_first, run_at_start = line, first_line
            run += 1
        else:
            if run == 1 and run_at_start:  # one blank line at the start, then text: no separator
                paragraph.append(run_first)
            elif run:
                yield "\n".join(paragraph)
                paragraph = []
            run = 0
            paragraph.append(line)
        first_line = False
    if run == 1:  # one blank line at the end: no separator, it belongs to the last paragraph
        paragraph.append(run_first)
    yield "\n".join(paragraph)


def file_text(lines: Iterator[str]) -> str:
    return "\n".join(lines)


def read_text_documents(path: Path, text_document: str, named: str) -> Iterator[str]:
    """The documents of the .txt file `path` (`text_document`: paragraph, line or file); `named` names it in
    errors, with what gave it (`--input a.txt`)."""
    lines = text_lines(path, named)
    if text_document == "paragraph":
        parts = paragraphs(lines)
    elif text_document == "line":
        parts = lines
    elif text_document == "file":
        parts = iter([file_text(lines)])
    else:
        raise ValueError(f"text_document={text_document!r}: expected one of {', '.join(TEXT_DOCUMENTS)}")
    for part in parts:
        if not blank(part):
            yield part.strip("\n")
