"""How step folders are read and written: torch DCP's file storage, made safe to load and checksummed.

Reading runs no code from the files and leaves the process as it was. DCP keeps a checkpoint's index
(`.metadata`) as a pickle and loads non-tensor values (optimizer hyperparameters and the like) with
`torch.load(weights_only=False)`; a crafted folder could run anything through either. Here the index is read
by PyTorch's weights_only unpickler (core/checkpointing/dcp_index.py) and values with
`torch.load(weights_only=True)`, each pickle first passed by core/checkpointing/pickle_guard.py (as is every item
DCP reads, tensors included: `SafeReader.read_data`); anything else is refused with a CheckpointError naming the
file. Every load in this repository goes through `SafeReader` and `SafeLoadPlanner` (resume, init_from, predict,
conversion).

Writing records a CRC-32 of every file as its bytes go to disk (no second read): each rank leaves
`__<rank>_checksums.json` beside its shards, which the completion marker collects (layout.write_marker).
CRC-32 catches corruption (any flipped bit, truncation, a torn write), not tampering.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
import zlib
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from core.checkpointing.dcp_index import INDEX_FILE, index_to_json, load_index
from core.checkpointing.pickle_guard import (
    PLAIN_DATA_GLOBALS,
    TENSOR_GLOBALS,
    UnsafeCheckpoint,
    check_torch_file,
    load_torch_file,
)

CHECKSUMS_SUFFIX = "checksums.json"  # per rank: __<rank>_checksums.json


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by PyTorch's weights_only unpickler, and each item it reads passed by
    the pickle guard first. Given `metadata` (the index as `layout.verify` read and checked it), it hands DCP that
    instead of reading the file again."""

    def __init__(self, path: str | os.PathLike, metadata: Optional[Metadata] = None):
        super().__init__(path)
        self.verified = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.verified is not None:
            metadata = self.verified
        else:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
                metadata = load_index(file.read())
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's reading, once every item it is to read has passed the pickle guard (check_item): DCP unpickles
        each one with torch.load, tensors included, which would build whatever the item's pickle asks for."""
        tensors: dict[Any, bool] = {}  # each storage item to read: whether it holds a tensor
        for item in plan.items:
            tensors.setdefault(item.storage_index, item.type != LoadItemType.BYTE_IO)
        by_file: dict[str, list] = {}
        for index, is_tensor in tensors.items():
            stored = self.storage_data[index]
            by_file.setdefault(stored.relative_path, []).append((index.fqn, stored, is_tensor))
        for name, items in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as shard:
                for fqn, stored, is_tensor in items:
                    problem = check_item(shard, stored.offset, stored.length, is_tensor)
                    if problem:
                        raise UnsafeCheckpoint(
                            f"refusing to load the {'tensor' if is_tensor else 'value'} {fqn!r} "
                            f"({name} at byte {stored.offset}): {problem}"
                        )
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values loaded as data only (plain containers and numbers), and each
    item read from storage of its own kind."""

    def create_local_plan(self):
        # A tensor is read from a tensor's chunks, a value from a value's bytes: a checkpoint that stores a weight
        # as bytes (or a value as a tensor) is refused before anything is read.
        for fqn, target in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if saved is not None and torch.is_tensor(target) != isinstance(saved, TensorStorageMetadata):
                stored = "a tensor" if isinstance(saved, TensorStorageMetadata) else "bytes"
                wanted = "a tensor" if torch.is_tensor(target) else "a value"
                raise UnsafeCheckpoint(f"{fqn!r} is stored as {stored}, where {wanted} belongs")
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        stored = self.metadata.storage_data.get(read_item.storage_index)
        what = f"the value {read_item.dest_index.fqn!r}" + (
            f" ({stored.relative_path} at byte {stored.offset})" if stored is not None else ""
        )
        try:
            loaded = load_torch_file(value.getvalue(), PLAIN_DATA_GLOBALS)
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"refusing to load {what}: {e}") from None
        except Exception as e:  # noqa: BLE001  (a refusal is an UnpicklingError; a malformed file anything)
            reason = next(
                (line.strip() for line in str(e).splitlines() if "Unsupported global" in line),
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            )
            raise UnsafeCheckpoint(f"refusing to load {what}: it is not plain data ({reason})") from None
        try:
            loaded = plain_copy(loaded)
        except (TypeError, RecursionError) as e:
            raise UnsafeCheckpoint(f"refusing to load {what}: {e}") from None
        # Hand DCP the value as a pickle of our own making, so that it places it as it always does.
        buffer = io.BytesIO()
        torch.save(loaded, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)


_SCALARS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def plain_copy(value: Any) -> Any:
    """`value`, as the weights_only unpickler built it, rebuilt from plain types: fresh containers (no instance
    attributes set by the file, e.g. an OrderedDict's own `__reduce__`) and detached tensors. TypeError for
    anything else."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
        return value.detach()
    if kind is torch.Size:
        return torch.Size(int(n) for n in value)
    if kind in (dict, OrderedDict):
        return kind((plain_copy(k), plain_copy(v)) for k, v in value.items())
    if kind in (list, tuple, set, frozenset):
        return kind(plain_copy(v) for v in value)
    raise TypeError(f"it holds a {kind.__name__}, which is not plain data")


class _Slice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own."""

    def __init__(self, file: io.BufferedReader, start: int, length: int):
        super().__init__()
        self.file, self.start, self.length, self.position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        self.file.seek(self.start + self.position)
        data = self.file.read(count)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def stored_plainly(file: io.BufferedReader, offset: int, length: int) -> Optional[str]:
    """What is wrong with the item at [offset, offset + length) of a shard, or None: DCP stores each item as a
    torch.save archive, whose entries torch writes uncompressed; a compressed entry would make what is loaded far
    larger than what is stored (an archive of a few MB unpacking to GBs)."""
    try:
        with zipfile.ZipFile(_Slice(file, offset, length)) as archive:
            entries = archive.infolist()
    # NotImplementedError: a header asks for a zip version Python cannot read (one flipped bit makes it so).
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError) as e:
        return f"not a torch.save archive ({type(e).__name__}: {e})"
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED or e.file_size != e.compress_size]
    if packed:
        return f"{packed[0]} is compressed"
    if sum(e.file_size for e in entries) > length:
        return "its entries claim more bytes than it holds"
    return None


def check_item(file: io.BufferedReader, offset: int, length: int, is_tensor: bool) -> Optional[str]:
    """What keeps the item at [offset, offset + length) of a shard from being read, or None. DCP stores each item
    as a torch.save archive and reads it with torch.load, tensors included, so each passes the guard every pickle
    of a checkpoint passes (core/checkpointing/pickle_guard.py): entries stored uncompressed, storages no larger
    than their records, a pickle naming only what a tensor (or, for a value, plain data) is saved with."""
    try:
        check_torch_file(
            _Slice(file, offset, length), TENSOR_GLOBALS if is_tensor else PLAIN_DATA_GLOBALS, zip_only=True
        )
    except UnsafeCheckpoint as e:
        return str(e)
    return None


# ---- writing, with a checksum per file


class _ChecksummingStream(io.RawIOBase):
    """A file opened for writing that updates a CRC-32 with every byte written in order."""

    def __init__(self, file: io.BufferedWriter):
        super().__init__()
        self.file, self.crc, self.written, self.sequential = file, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.written += view.nbytes
        return self.file.write(view)

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = self.file.seek(offset, whence)
        if position != self.written:
            self.sequential = False
        return position

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self):
        self.checksums: dict[str, int] = {}  # file name -> CRC-32 of its bytes

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as file:
            stream = _ChecksummingStream(file)
            yield stream
            stream.flush()
        # A writer that seeks back cannot be followed byte by byte: read the file once instead.
        self.checksums[Path(path).name] = stream.crc if stream.sequential else file_crc32(Path(path))


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that leaves `__<rank>_checksums.json`: the CRC-32 of each file this rank wrote."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()

    def finish(self, metadata: Metadata, results) -> None:
        """DCP's index as its pickle (.metadata, for DCP and other tools) and as JSON (index.json, which this
        tool reads: core/checkpointing/dcp_index.py). Runs on the coordinating rank, after every rank wrote."""
        super().finish(metadata, results)
        # The index as the pickle holds it: some PyTorch versions fill in the version and where each item lies
        # on a copy of `metadata` only, so both are taken here as they do.
        where = {result.index: result.storage_data for per_rank in results for result in per_rank}
        written = dataclasses.replace(metadata, version=CURRENT_DCP_VERSION, storage_data=where)
        index = Path(self.path) / INDEX_FILE
        temporary = index.with_name(INDEX_FILE + ".tmp")
        temporary.write_bytes(index_to_json(written))
        os.replace(temporary, index)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()  # the file writer is synchronous; in an async save this runs in the writer thread
        prefix = plan.storage_data.prefix
        mine = {name: crc for name, crc in self.fs.checksums.items() if name.startswith(prefix)}
        sidecar = Path(self.path) / f"{prefix}{CHECKSUMS_SUFFIX}"
        tmp = sidecar.with_suffix(".tmp")
        tmp.write_text(json.dumps(mine))
        os.replace(tmp, sidecar)
        return future


def is_checksum_sidecar(name: str) -> bool:
    return name.startswith("__") and name.endswith("_" + CHECKSUMS_SUFFIX)


def collect_checksums(folder: Path) -> dict[str, int]:
    """The CRC-32s every rank recorded while writing `folder`."""
    found: dict[str, int] = {}
    for sidecar in Path(folder).iterdir():
        if is_checksum_sidecar(sidecar.name):
            found.update(json.loads(sidecar.read_text()))
    return found


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc
