"""Parquet files whose text columns are read without letting a small file expand to gigabytes.

Parquet stores a repeated value once (dictionary encoding) and compresses it: a file of a few KB can hold 65,536
rows of one 1 MiB string, which pyarrow's readers expand to 64 GiB. Here every text value of the columns read, at
the top level or inside lists and structs (a chat's messages), is read as a dictionary (each distinct value once),
a batch of rows at a time; the expanded size of each batch is computed from the dictionary before any value is
copied out, and a value or a file that would expand past its bound is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

BATCH_ROWS = 8192
MIN_BUDGET_BYTES = 256 << 20  # any file may expand to this much text
MAX_EXPANSION = 1000  # and to this many times its size on disk (real data: a few times)
PAGE_OVERHEAD_BYTES = 1 << 20  # page headers and dictionary pages beside the values


class TextRefused(ValueError):
    """Text that would expand too far, or a column named twice; the message reads after the file's name."""


def _is_text(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _holds_text(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _holds_text(t.value_type)
    return _is_text(t) or any(_holds_text(t.field(i).type) for i in range(getattr(t, "num_fields", 0)))


def _text_leaves(file, columns: Sequence[str]) -> list[str]:
    """The paths of the stored byte-array (text) columns within `columns`: "sequence",
    "messages.list.element.content"."""
    schema = file.schema
    paths = [schema.column(i).path for i in range(len(schema)) if schema.column(i).physical_type == "BYTE_ARRAY"]
    return [p for p in paths if any(p == c or p.startswith(c + ".") for c in columns)]


def _check_stored_sizes(meta, columns: Sequence[str], text: list[str], max_value_bytes: int, budget: int) -> None:
    """From the metadata, before any page is read: a top-level text column's pages hold no more bytes than its rows'
    values may, and all text pages no more than the file's budget (a page is decompressed whole: one 256 MiB value
    compresses to a few KB)."""
    stored = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if column.path_in_schema not in text:
                continue
            stored += column.total_uncompressed_size
            one_a_row = column.path_in_schema in columns
            if one_a_row and column.total_uncompressed_size > max_value_bytes * group.num_rows + PAGE_OVERHEAD_BYTES:
                raise TextRefused(
                    f"row group {g + 1} stores {column.total_uncompressed_size} bytes of column "
                    f"{column.path_in_schema!r} for {group.num_rows} rows (at most {max_value_bytes} a value)"
                )
    if stored > budget:
        raise TextRefused(f"its text columns store {stored} bytes uncompressed, past its bound of {budget}")


class _Expansion:
    """The text expanded so far from one file, against its bounds: each value, and the whole."""

    def __init__(self, size: int, max_value_bytes: int):
        self.size, self.max_value_bytes = size, max_value_bytes
        self.budget, self.total = max(MIN_BUDGET_BYTES, MAX_EXPANSION * size), 0

    def add(self, name: str, lengths) -> None:
        import pyarrow.compute as pc

        longest = pc.max(lengths).as_py()
        if longest is not None and longest > self.max_value_bytes:
            raise TextRefused(f"a value of column {name!r} holds {longest} bytes (at most {self.max_value_bytes})")
        self.total += pc.sum(lengths).as_py() or 0
        if self.total > self.budget:
            raise TextRefused(
                f"its text expands to more than {self.budget} bytes, the bound for a file of {self.size} bytes "
                f"({MAX_EXPANSION} times its size, at least {MIN_BUDGET_BYTES}): a decompression bomb?"
            )

    def expanded(self, name: str, array):
        """`array` with its text dictionaries (at any depth in lists and structs) expanded, each counted first."""
        import pyarrow as pa
        import pyarrow.compute as pc

        t = array.type
        if pa.types.is_dictionary(t) and _is_text(t.value_type):
            self.add(name, pc.binary_length(array.dictionary).take(array.indices))  # each distinct value once
            return array.dictionary.take(array.indices)
        if _is_text(t):
            self.add(name, pc.binary_length(array))
            return array
        if not _holds_text(t):
            return array
        mask = array.is_null() if array.null_count else None
        if pa.types.is_struct(t):
            children = [self.expanded(name, array.field(i)) for i in range(t.num_fields)]
            fields = [pa.field(f.name, c.type, f.nullable, f.metadata) for f, c in zip(t, children)]
            return pa.StructArray.from_arrays(children, fields=fields, mask=mask)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            values = self.expanded(name, array.values)
            item = pa.field(t.value_field.name, values.type, t.value_field.nullable, t.value_field.metadata)
            list_type = pa.list_(item) if pa.types.is_list(t) else pa.large_list(item)
            return type(array).from_arrays(array.offsets, values, type=list_type, mask=mask)
        kind = str(t).split("<", 1)[0]
        raise TextRefused(
            f"column {name!r} holds text within a {kind}: text is read as strings, or lists and structs of them"
        )


def _batches(file, columns: Sequence[str], batch_rows: int):
    """The file's batches, one row group at a time: pyarrow cannot join two row groups' dictionaries within lists."""
    for group in range(file.metadata.num_row_groups):
        yield from file.iter_batches(batch_size=batch_rows, row_groups=[group], columns=list(columns))


def text_batches(
    path: Path, columns: Sequence[str], max_value_bytes: int, batch_rows: int = BATCH_ROWS
) -> Iterator["pyarrow.RecordBatch"]:  # noqa: F821
    """The record batches of `columns`, each text value (top-level, or within lists and structs) checked before it
    is expanded: TextRefused when a column is named twice, a value is longer than `max_value_bytes`, or the text
    read so far exceeds the file's budget (MAX_EXPANSION times its size, at least MIN_BUDGET_BYTES)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    for name in columns:
        if len(schema.get_all_field_indices(name)) != 1:  # which one was meant?
            raise TextRefused(f"{len(schema.get_all_field_indices(name))} columns are named {name!r}: keep one")
    text = _text_leaves(pq.ParquetFile(path), columns)
    file = pq.ParquetFile(path, read_dictionary=text)
    expansion = _Expansion(path.stat().st_size, max_value_bytes)
    _check_stored_sizes(file.metadata, columns, text, max_value_bytes, expansion.budget)
    for batch in _batches(file, columns, batch_rows):
        plain = [expansion.expanded(name, column) for name, column in zip(batch.schema.names, batch.columns)]
        yield pa.RecordBatch.from_arrays(plain, names=batch.schema.names)
