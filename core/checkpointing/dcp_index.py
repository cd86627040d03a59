"""DCP's checkpoint index (`.metadata`) read without letting the file run code or change the process.

DCP pickles its index with Python's default pickle protocol and unpickles it with `pickle.load`, which runs
whatever the file asks for. Here it is read by PyTorch's own `weights_only` unpickler (the one behind
`torch.load(weights_only=True)`), which builds only what plain data needs: containers, numbers, strings,
dtypes, sizes, and fresh instances of the classes named below (DCP's metadata dataclasses and paths); it
refuses every other global, code-running opcodes (INST, OBJ, extension codes, persistent ids) and
attribute setting (BUILD) on anything but an instance of an allowed class that the same file created.
That unpickler reads protocol 2 only, so the index is first rewritten opcode by opcode from the newer
protocol into protocol 2 (`to_protocol_2`): framing dropped, memo and string opcodes re-encoded, a
global named by two strings (STACK_GLOBAL) written as the protocol-2 GLOBAL; any opcode without a
protocol-2 form is refused. The rewrite only changes the encoding, and reads the opcodes through the guard every
pickle of a checkpoint passes (core/checkpointing/pickle_guard.py: globals an index names, no shared containers
that would make a walk over the index longer than the file): what the result may build is decided by PyTorch's
unpickler. Last, the unpickled index is checked against the shape DCP's code expects
(`check_shape`), so nothing downstream meets an object of an unexpected type.

Step folders this tool writes also hold the index as JSON (`index.json`, written beside `.metadata` by
core/checkpointing/storage.py), which is read instead: no pickle at all, parsed against its shape by pydantic
(`index_from_json`). The pickle path serves DCP folders from elsewhere and checkpoints written before it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pathlib
import struct
import threading
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError
from torch import _weights_only_unpickler
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from core.checkpointing.pickle_guard import MAX_INDEX_PICKLE, AllowList, UnsafeCheckpoint, guarded_opcodes


def _memory_format(code: int) -> dcp_metadata._MEM_FORMAT_ENCODING:
    """The enum member for a memory-format code. Registered under the enum's own name, so that the index
    can look members up but never holds the enum class itself: with the class allowed, BUILD could set
    attributes on its members, which live for the whole process."""
    return dcp_metadata._MEM_FORMAT_ENCODING(code)


# What an index may build beyond PyTorch's defaults (torch.Size, dtypes, layouts).
_ALLOWED: list = [
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    _StorageInfo,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    (pathlib.PureWindowsPath, "pathlib.WindowsPath"),  # an index written on Windows: its path, not a live one
    (_memory_format, "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"),
]
# torch's list of allowed globals is process-wide: one index at a time adds ours to it and takes them away.
_ALLOWED_LOCK = threading.Lock()
# The globals an index names: ours above and, of PyTorch's defaults, only sizes, dtypes, layouts and
# OrderedDict. The guard refuses any other name before PyTorch's unpickler sees it: its defaults also
# allow globals an index never needs, some of which allocate what the file asks for (bytearray(2**31),
# torch.Tensor(2**31)) or import modules (_codecs.encode).
_INDEX_GLOBALS = AllowList(
    {entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}" for entry in _ALLOWED}
    | {"torch.Size", "torch.serialization._get_layout", "collections.OrderedDict"}
    | {f"torch.{name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)},
    "a DCP index holds",
)

# Protocol-2 opcodes that PyTorch's unpickler reads and that the rewrite copies as they are.
_COPIED = {
    "APPEND",
    "APPENDS",
    "BINFLOAT",
    "BININT",
    "BININT1",
    "BININT2",
    "BUILD",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "EMPTY_TUPLE",
    "LONG1",
    "MARK",
    "NEWFALSE",
    "NEWTRUE",
    "NEWOBJ",
    "NONE",
    "REDUCE",
    "SETITEM",
    "SETITEMS",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
_PUTS = {"MEMOIZE", "BINPUT", "LONG_BINPUT"}
_GETS = {"BINGET", "LONG_BINGET"}


def to_protocol_2(data: bytes) -> bytes:
    """The same pickle in the opcodes of protocol 2 (see the module docstring); UnsafeCheckpoint for an opcode
    that has no protocol-2 form, or for what core/checkpointing/pickle_guard.py refuses (a global an index does
    not name, shared containers that a walk over the index would visit more often than it has bytes, ...).

    Strings are held back until an opcode uses them, because STACK_GLOBAL takes its module and name from the
    stack, where protocol 2 has no way to remove them: a string that STACK_GLOBAL consumes is never written,
    a memoized string is remembered by value, and every other memo entry gets a slot of its own."""
    out = bytearray(b"\x80\x02")
    pending: list[str] = []  # strings pushed by the source, not yet written
    memo: dict[int, tuple[str, Any]] = {}  # source memo index -> ("str", value) or ("slot", output memo index)
    slots = 0

    def flush() -> None:
        for text in pending:
            encoded = text.encode("utf-8", "surrogatepass")
            out.extend(b"X" + struct.pack("<I", len(encoded)) + encoded)
        pending.clear()

    copy_from = None  # where an opcode to copy as it is starts; it ends where the next one starts
    for op, arg, position in guarded_opcodes(data, _INDEX_GLOBALS, max_length=MAX_INDEX_PICKLE):
        if copy_from is not None:
            out.extend(data[copy_from:position])
            copy_from = None
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name in _STRINGS:
            pending.append(arg)
        elif name in _PUTS:
            index = len(memo) if name == "MEMOIZE" else arg
            if pending:  # the top of the stack is the newest held-back string
                memo[index] = ("str", pending[-1])
            else:
                memo[index] = ("slot", slots)
                out.extend(b"q" + bytes([slots]) if slots < 256 else b"r" + struct.pack("<I", slots))
                slots += 1
        elif name in _GETS:
            if arg not in memo:
                raise UnsafeCheckpoint(f"opcode {name} at byte {position} reads memo entry {arg}, which was never set")
            kind, value = memo[arg]
            if kind == "str":
                pending.append(value)
            else:
                flush()
                out.extend(b"h" + bytes([value]) if value < 256 else b"j" + struct.pack("<I", value))
        elif name == "STACK_GLOBAL":
            if len(pending) < 2:
                raise UnsafeCheckpoint(f"opcode STACK_GLOBAL at byte {position} names a global by computed values")
            global_name, module = pending.pop(), pending.pop()
            flush()
            out.extend(b"c" + f"{module}\n{global_name}\n".encode("utf-8", "surrogatepass"))
        elif name == "GLOBAL":
            module, _, global_name = arg.partition(" ")
            flush()
            out.extend(b"c" + f"{module}\n{global_name}\n".encode("utf-8", "surrogatepass"))
        elif name in _COPIED:
            flush()
            copy_from = position
        elif name == "STOP":
            flush()
            out.extend(b".")
        else:
            raise UnsafeCheckpoint(f"opcode {name} at byte {position} is not plain data")
    return bytes(out)


def load_index(data: bytes) -> Metadata:
    """A DCP index from the bytes of a `.metadata` file; UnsafeCheckpoint (with the reason) for anything that
    is not plain DCP metadata."""
    try:
        rewritten = to_protocol_2(data)
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"refusing to load it: {e}") from None
    try:
        with _ALLOWED_LOCK, torch.serialization.safe_globals(_ALLOWED):
            index = _weights_only_unpickler.load(io.BytesIO(rewritten))
    except Exception as e:  # noqa: BLE001  (the unpickler's refusals are UnpicklingErrors; malformed data anything)
        raise UnsafeCheckpoint(f"refusing to load it: {_first_line(e)}") from None
    try:
        check_shape(index)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001  (e.g. an instance built without its fields)
        raise UnsafeCheckpoint(f"not DCP metadata ({_first_line(e)})") from None
    return index


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# ---- the shape DCP's code expects of an index


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise UnsafeCheckpoint(f"not DCP metadata: {what}")


# A tensor of more elements than this is no checkpoint's (2**50 bytes and more); a bound keeps every size
# computation in range.
MAX_ELEMENTS = 2**50
MAX_DIMS = 64  # the most dimensions a torch tensor can have


def _is_size(value: Any) -> bool:
    """A torch.Size, or the tuple some writers keep instead, of at most MAX_DIMS whole numbers >= 0 whose product
    is below MAX_ELEMENTS."""
    return (
        isinstance(value, tuple)
        and len(value) <= MAX_DIMS
        and all(type(n) is int and 0 <= n < MAX_ELEMENTS for n in value)
        and math.prod(max(n, 1) for n in value) < MAX_ELEMENTS
    )  # a 0 among the sizes hides no overflow


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _is_plain_file_name(name: Any) -> bool:
    """A file directly inside the checkpoint folder: no folder part, not `.` or `..`."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def _has_fields_only(obj: Any) -> bool:
    """The instance holds exactly its dataclass fields (a field left at its class default may be absent), nothing
    smuggled beside them."""
    names = {f.name for f in dataclasses.fields(obj)}
    return set(vars(obj)) <= names and all(hasattr(obj, name) for name in names)


def check_shape(index: Any) -> None:
    """Raise UnsafeCheckpoint unless `index` is a Metadata whose every part has the type DCP expects."""
    _expect(type(index) is Metadata and _has_fields_only(index), f"holds a {type(index).__name__}, not DCP metadata")
    _check_entries(index.state_dict_metadata)
    _check_storage(index.storage_data)
    _check_run_fields(index)


def _check_entries(entries: Any) -> None:
    """Each state dict entry: bytes, or a tensor with plain properties, a size and chunks inside that size."""
    _expect(type(entries) is dict, "state_dict_metadata is not a dict")
    checked: set[tuple[int, tuple]] = set()  # (chunk list, size) pairs already checked: each list is read once
    for key, entry in entries.items():
        _expect(isinstance(key, str), f"a state dict key of type {type(key).__name__}")
        if type(entry) is BytesStorageMetadata:
            continue
        _expect(type(entry) is TensorStorageMetadata and _has_fields_only(entry), f"{key!r} is a malformed entry")
        props = entry.properties
        _expect(
            type(props) is TensorProperties
            and props.dtype in _DTYPES.values()
            and isinstance(props.layout, torch.layout)
            and type(props.requires_grad) is bool
            and type(props.pin_memory) is bool
            and isinstance(props.memory_format, torch.memory_format),
            f"{key!r} has malformed tensor properties",
        )
        _expect(_is_size(entry.size), f"{key!r} has a malformed size")
        _expect(type(entry.chunks) is list, f"{key!r} has malformed chunks")
        if (id(entry.chunks), entry.size) in checked:
            continue
        checked.add((id(entry.chunks), entry.size))
        for chunk in entry.chunks:
            _expect(
                type(chunk) is ChunkStorageMetadata
                and _has_fields_only(chunk)
                and _is_size(chunk.offsets)
                and _is_size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                and all(o + n <= full for o, n, full in zip(chunk.offsets, chunk.sizes, entry.size)),
                f"{key!r} has a chunk outside its size",
            )


def _check_storage(storage: Any) -> None:
    """Each stored item: a key naming a tensor (and chunk offsets) mapped to a plain file of the folder."""
    _expect(type(storage) is dict, "storage_data is not a dict")
    for where, info in storage.items():
        _expect(
            type(where) is MetadataIndex
            and _has_fields_only(where)
            and isinstance(where.fqn, str)
            and (where.offset is None or _is_size(where.offset)),
            "a malformed storage key",
        )
        _expect(
            type(info) is _StorageInfo
            and _has_fields_only(info)
            and _is_plain_file_name(info.relative_path)
            and _is_int(info.offset)
            and _is_int(info.length),
            f"storage of {where.fqn!r}: not a file of the folder with an offset and length",
        )
        # Compressed storage would make what is built larger than what is stored: this tool writes none.
        _expect(
            not getattr(info, "transform_descriptors", None),
            f"storage of {where.fqn!r} is compressed (transform descriptors), which this tool does not read",
        )
    _check_separate(storage)


def _check_separate(storage: dict) -> None:
    """No two stored items share bytes. Each is read into a tensor or value of its own, sized by the index, so
    items that all point at one range would make a small folder cost many times its size; DCP writes every item
    to bytes of its own."""
    by_file: dict[str, list] = {}
    for where, info in storage.items():
        if info.length:  # an empty range shares nothing
            by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, where))
    for name, items in by_file.items():
        items.sort(key=lambda item: (item[0], item[1]))
        reach, widest = 0, None  # the furthest end so far, and the item that reaches it
        for start, end, where in items:
            if widest is not None and start < reach:
                raise UnsafeCheckpoint(
                    f"the storage of {_item(widest)} and of {_item(where)} share bytes of {name} "
                    f"(from byte {start}); each item is stored once"
                )
            if end > reach:
                reach, widest = end, where


def _item(where: MetadataIndex) -> str:
    """A storage key as a message names it: its state dict key, and the chunk's offsets for a piece of a tensor."""
    return repr(where.fqn) + (f" at {list(where.offset)}" if where.offset and any(where.offset) else "")


def _check_run_fields(index: Metadata) -> None:
    """The fields that describe the save (storage_meta, version, planner_data): absent or of plain types."""
    meta = index.storage_meta
    _expect(
        meta is None
        or (
            type(meta) is StorageMeta
            and _has_fields_only(meta)
            and type(meta.modules) is list
            and all(isinstance(m, str) for m in meta.modules)
            and all(v is None or isinstance(v, str) for v in (meta.save_id, meta.load_id))
            and (meta.checkpoint_id is None or isinstance(meta.checkpoint_id, (str, pathlib.PurePath)))
        ),
        "malformed storage_meta",
    )
    _expect(index.version is None or isinstance(index.version, str), "malformed version")
    planner = index.planner_data
    _expect(
        planner is None
        or (
            type(planner) is dict
            and all(
                isinstance(k, str)
                and isinstance(v, (tuple, list))
                and all(isinstance(props, (str, int)) for props in v)
                for k, v in planner.items()
            )
        ),
        "malformed planner_data",
    )


# ---- the index as JSON: what step folders of this tool hold beside .metadata

INDEX_FILE = "index.json"
# The dtypes a checkpoint's tensors have (not quantized or bit-packed ones, which no part of a run saves).
_DTYPES = {
    str(d): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
    and (
        d.is_floating_point
        or d.is_complex
        or d == torch.bool
        or d
        in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64)
    )
}
_LAYOUTS = {str(torch.strided): torch.strided}
_MEMORY_FORMATS = {
    str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}
Count = NonNegativeInt


class _Plain(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Chunk(_Plain):
    offsets: list[Count]
    sizes: list[Count]


class _Tensor(_Plain):
    kind: Literal["tensor"]
    dtype: str
    layout: str
    memory_format: str
    requires_grad: bool
    pin_memory: bool
    size: list[Count]
    chunks: list[_Chunk]


class _Bytes(_Plain):
    kind: Literal["bytes"]


class _Stored(_Plain):
    fqn: str
    offset: Optional[list[Count]]  # the chunk's offsets in its tensor; null for a non-tensor value
    index: Optional[Count]
    file: str
    at: Count
    length: Count


class _Index(_Plain):
    format: Literal[1]
    version: Optional[str]
    entries: dict[str, Annotated[Union[_Tensor, _Bytes], Field(discriminator="kind")]]
    storage: list[_Stored]
    planner_data: Optional[dict[str, list[Union[str, int]]]]


def index_to_json(index: Metadata) -> bytes:
    """DCP's index as JSON (index_from_json reads it back), for a step folder of this tool."""
    entries = {}
    for key, entry in index.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            entries[key] = {"kind": "bytes"}
            continue
        props = entry.properties
        entries[key] = {
            "kind": "tensor",
            "dtype": str(props.dtype),
            "layout": str(props.layout),
            "memory_format": str(props.memory_format),
            "requires_grad": props.requires_grad,
            "pin_memory": props.pin_memory,
            "size": list(entry.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks],
        }
    storage = [
        {
            "fqn": where.fqn,
            "offset": None if where.offset is None else list(where.offset),
            "index": where.index,
            "file": info.relative_path,
            "at": info.offset,
            "length": info.length,
        }
        for where, info in index.storage_data.items()
    ]
    planner = {k: list(v) for k, v in index.planner_data.items()} if isinstance(index.planner_data, dict) else None
    return json.dumps(
        {"format": 1, "version": index.version, "entries": entries, "storage": storage, "planner_data": planner},
        separators=(",", ":"),
    ).encode()


def _known(table: dict, name: str, what: str) -> Any:
    if name not in table:
        raise UnsafeCheckpoint(f"not an index of this tool: {what} {name!r}")
    return table[name]


def index_from_json(data: bytes) -> Metadata:
    """The DCP index of an index.json; UnsafeCheckpoint (with the reason) for anything of another shape."""
    try:
        parsed = _Index.model_validate_json(data)
    except ValidationError as e:
        raise UnsafeCheckpoint(
            f"not an index of this tool ({e.error_count()} problems; first: "
            f"{e.errors(include_url=False)[0]['loc']}: {e.errors(include_url=False)[0]['msg']})"
        ) from None
    entries: dict[str, Any] = {}
    for key, entry in parsed.entries.items():
        if isinstance(entry, _Bytes):
            entries[key] = BytesStorageMetadata()
            continue
        properties = TensorProperties(
            dtype=_known(_DTYPES, entry.dtype, "dtype"),
            layout=_known(_LAYOUTS, entry.layout, "layout"),
            requires_grad=entry.requires_grad,
            memory_format=_known(_MEMORY_FORMATS, entry.memory_format, "memory format"),
            pin_memory=entry.pin_memory,
        )
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in entry.chunks]
        entries[key] = TensorStorageMetadata(properties=properties, size=torch.Size(entry.size), chunks=chunks)
    storage = {
        MetadataIndex(s.fqn, None if s.offset is None else torch.Size(s.offset), s.index): _StorageInfo(
            relative_path=s.file, offset=s.at, length=s.length
        )
        for s in parsed.storage
    }
    planner = {k: tuple(v) for k, v in parsed.planner_data.items()} if parsed.planner_data is not None else None
    index = Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=parsed.version,
    )
    check_shape(index)
    return index
