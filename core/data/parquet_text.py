"""Parquet files whose text columns are read without letting a small file expand to gigabytes.

Parquet stores a repeated value once (dictionary encoding) and compresses it: a file of a few KB can hold 65,536
rows of one 1 MiB string, which pyarrow's readers expand to 64 GiB. Here the text columns are read as dictionaries
(each distinct value once), a batch of rows at a time; the expanded size of each batch is computed from the
dictionary before any value is copied out, and a value or a file that would expand past its bound is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence

BATCH_ROWS = 8192
MIN_BUDGET_BYTES = 256 << 20  # any file may expand to this much text
MAX_EXPANSION = 1000  # and to this many times its size on disk (real data: a few times)
PAGE_OVERHEAD_BYTES = 1 << 20  # page headers and dictionary pages beside the values


class TextRefused(ValueError):
    """Text that would expand too far, or a column named twice; the message reads after the file's name."""


def _is_text(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _check_stored_sizes(meta, text: list[str], max_value_bytes: int, budget: int) -> None:
    """From the metadata, before any page is read: a text column's pages hold no more bytes than its rows' values
    may, nor than the file's budget (a page is decompressed whole: one 256 MiB value compresses to a few KB)."""
    stored = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if column.path_in_schema not in text:
                continue
            stored += column.total_uncompressed_size
            if column.total_uncompressed_size > max_value_bytes * group.num_rows + PAGE_OVERHEAD_BYTES:
                raise TextRefused(
                    f"row group {g + 1} stores {column.total_uncompressed_size} bytes of column "
                    f"{column.path_in_schema!r} for {group.num_rows} rows (at most {max_value_bytes} a value)"
                )
    if stored > budget:
        raise TextRefused(f"its text columns store {stored} bytes uncompressed, past its bound of {budget}")


def text_batches(
    path: Path, columns: Sequence[str], max_value_bytes: int, batch_rows: int = BATCH_ROWS
) -> Iterator["pyarrow.RecordBatch"]:  # noqa: F821
    """The record batches of `columns`, each text column checked before it is expanded: TextRefused when a column
    is named twice, a value is longer than `max_value_bytes`, or the text read so far exceeds the file's budget
    (MAX_EXPANSION times its size, at least MIN_BUDGET_BYTES)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    for name in columns:
        if len(schema.get_all_field_indices(name)) != 1:  # which one was meant?
            raise TextRefused(f"{len(schema.get_all_field_indices(name))} columns are named {name!r}: keep one")
    text = [c for c in columns if _is_text(schema.field(c).type)]
    file = pq.ParquetFile(path, read_dictionary=text)
    size = path.stat().st_size
    budget, total = max(MIN_BUDGET_BYTES, MAX_EXPANSION * size), 0
    _check_stored_sizes(file.metadata, text, max_value_bytes, budget)
    for batch in file.iter_batches(batch_size=batch_rows, columns=list(columns)):
        plain = []
        for name, column in zip(batch.schema.names, batch.columns):
            encoded = pa.types.is_dictionary(column.type)
            if name in text:  # the lengths from each distinct value once, before the copies
                lengths = (
                    pc.binary_length(column.dictionary).take(column.indices) if encoded else pc.binary_length(column)
                )
                longest: Optional[int] = pc.max(lengths).as_py()
                if longest is not None and longest > max_value_bytes:
                    raise TextRefused(f"a value of column {name!r} holds {longest} bytes (at most {max_value_bytes})")
                total += pc.sum(lengths).as_py() or 0
                if total > budget:  # before the values are copied out
                    raise TextRefused(
                        f"its text expands to more than {budget} bytes, the bound for a file of {size} bytes "
                        f"({MAX_EXPANSION} times its size, at least {MIN_BUDGET_BYTES}): a decompression bomb?"
                    )
            plain.append(column.dictionary.take(column.indices) if encoded and name in text else column)
        yield pa.RecordBatch.from_arrays(plain, names=batch.schema.names)
