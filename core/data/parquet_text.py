"""Parquet files whose text columns are read without letting a small file expand to gigabytes.

Parquet stores a repeated value once (dictionary encoding) and compresses it: a file of a few KB can hold 65,536
rows of one 1 MiB string, which pyarrow's readers expand to 64 GiB. Here the text columns are read as dictionaries
(each distinct value once), a batch of rows at a time; the expanded size of each batch is computed from the
dictionary before any value is copied out, and a value or a file that would expand past its bound is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence

BATCH_ROWS = 1024
MIN_BUDGET_BYTES = 256 << 20  # any file may expand to this much text
MAX_EXPANSION = 1000  # and to this many times its size on disk (real data: a few times)


class ExpandsTooFar(ValueError):
    """The message reads after the file's name."""


def text_batches(
    path: Path, columns: Sequence[str], max_value_bytes: int, batch_rows: int = BATCH_ROWS
) -> Iterator["pyarrow.RecordBatch"]:  # noqa: F821
    """The record batches of `columns` (text columns as DictionaryArrays: `to_pylist` gives plain values);
    ExpandsTooFar when a text value is longer than `max_value_bytes` or the text read so far exceeds the file's
    budget (max(MIN_BUDGET_BYTES, MAX_EXPANSION x its size))."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    text = [
        c
        for c in columns
        if pa.types.is_string(t := schema.field(c).type)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ]
    budget = max(MIN_BUDGET_BYTES, MAX_EXPANSION * path.stat().st_size)
    total = 0
    for batch in pq.ParquetFile(path, read_dictionary=text).iter_batches(batch_size=batch_rows, columns=list(columns)):
        for name in text:
            column = batch.column(name)
            if not pa.types.is_dictionary(column.type):  # already plain: its size is its buffers'
                lengths = pc.binary_length(column)
            else:
                lengths = pc.binary_length(column.dictionary).take(column.indices)
            longest: Optional[int] = pc.max(lengths).as_py()
            if longest is not None and longest > max_value_bytes:
                raise ExpandsTooFar(f"a value of column {name!r} holds {longest} bytes (at most {max_value_bytes})")
            total += pc.sum(lengths).as_py() or 0
        if total > budget:
            raise ExpandsTooFar(
                f"its text expands to more than {budget} bytes, the bound for a file of {path.stat().st_size} bytes "
                f"({MAX_EXPANSION} times its size, at least {MIN_BUDGET_BYTES}): a decompression bomb?"
            )
        yield batch
