"""How many bytes an Arrow IPC file's record batches hold once decompressed, read from its messages' headers
before any batch is.

Arrow IPC (`datasets`' stream files, Feather v2) may compress each buffer (LZ4 or ZSTD: Feather's default), and
pyarrow decompresses a whole record batch as it reads it: a file of a few hundred KB can hold one batch of
gigabytes. Each compressed buffer starts with its decompressed length (Arrow's Message.fbs: -1 when it is
stored as is), and the message's header (a FlatBuffer) says where the buffers lie in its body; both are read
here without decompressing anything, so a reader can refuse a file before it expands.
"""

from __future__ import annotations

import struct
from typing import Optional

_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # Message.fbs's MessageHeader union
_BUFFER = struct.Struct("<qq")  # Buffer: offset and length in the body


class IpcLayoutError(ValueError):
    """A message header that is not the FlatBuffer Arrow writes (damaged or crafted)."""


def _u32(data: bytes, at: int) -> int:
    if not 0 <= at <= len(data) - 4:
        raise IpcLayoutError(f"an offset {at} outside a header of {len(data)} bytes")
    return struct.unpack_from("<I", data, at)[0]


def _field(data: bytes, table: int, index: int) -> Optional[int]:
    """Where field `index` of the table at `table` lies (None: absent, the default)."""
    vtable = table - struct.unpack_from("<i", data, table)[0] if 0 <= table <= len(data) - 4 else -1
    if not 0 <= vtable <= len(data) - 4:
        raise IpcLayoutError(f"a table at {table} with no vtable in a header of {len(data)} bytes")
    size = struct.unpack_from("<H", data, vtable)[0]
    slot = 4 + 2 * index
    offset = struct.unpack_from("<H", data, vtable + slot)[0] if slot + 2 <= size else 0
    return table + offset if offset else None


def _table(data: bytes, table: int, index: int) -> Optional[int]:
    at = _field(data, table, index)
    return None if at is None else at + _u32(data, at)


def _batch_table(data: bytes) -> Optional[int]:
    """The RecordBatch table of a message header (a dictionary batch's data), or None for another message."""
    message = _u32(data, 0)
    kind = _field(data, message, 1)
    kind = data[kind] if kind is not None and kind < len(data) else 0
    if kind not in (_RECORD_BATCH, _DICTIONARY_BATCH):
        return None
    header = _table(data, message, 2)
    if header is None:
        raise IpcLayoutError("a batch message without its header")
    return header if kind == _RECORD_BATCH else _table(data, header, 1)


def batch_bytes(metadata: bytes, body) -> int:
    """The bytes a record or dictionary batch message's buffers take once read: each compressed buffer's declared
    length, each other buffer's own (0 for another kind of message). `body`: the message's body, read only at
    the first 8 bytes of each compressed buffer. IpcLayoutError for a header that is no Arrow FlatBuffer."""
    try:
        return _batch_bytes(metadata, body)
    except struct.error as e:  # a field read past the header's end
        raise IpcLayoutError(str(e)) from None


def _batch_bytes(metadata: bytes, body) -> int:
    batch = _batch_table(metadata)
    if batch is None:
        return 0
    compressed = _field(metadata, batch, 3) is not None  # a BodyCompression table
    vector = _table(metadata, batch, 2)
    count = _u32(metadata, vector) if vector is not None else 0
    if vector is None or vector + 4 + count * _BUFFER.size > len(metadata):
        raise IpcLayoutError(f"{count} buffers past the end of a header of {len(metadata)} bytes")
    total = 0
    for i in range(count):
        offset, length = _BUFFER.unpack_from(metadata, vector + 4 + i * _BUFFER.size)
        if offset < 0 or length < 0 or offset + length > len(body):
            raise IpcLayoutError(f"buffer {i} at {offset}+{length} lies outside a body of {len(body)} bytes")
        if compressed and length >= 8:
            declared = struct.unpack("<q", bytes(body[offset : offset + 8]))[0]
            total += length - 8 if declared == -1 else max(declared, 0)
        else:
            total += length
    return total
