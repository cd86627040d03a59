"""Every known pickle trick, in every kind of file a checkpoint load unpickles, is refused and leaves the
process as it was: DCP's index (`.metadata`, read by verify for our step folders and by verify_plain_dcp for
DCP folders from elsewhere), non-tensor values in `.distcp` shards, torch weight files (init_from, predict,
from-torch, to-hf --config) and Hugging Face `pytorch_model.bin` (from-hf). A control runs each trick through
plain `pickle.loads` in another process, to show that the trick really does harm where it is not refused.
The entry points reach these readers on every path: tests/unit/checkpointing/test_checkpoint_safety.py runs them
end to end."""

from __future__ import annotations

import io
import json
import pathlib
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import WriteItemType

from core.checkpointing.dcp_index import load_index
from core.checkpointing.hf_folders import read_hf_weights
from core.checkpointing.layout import CheckpointError, start_marker, verify, verify_plain_dcp, write_marker
from core.checkpointing.storage import ChecksummingWriter, SafeLoadPlanner, SafeReader
from core.checkpointing.weights import load_weights_file

PLACEHOLDER = "TRICK_GOES_HERE"


def _text(value: str) -> bytes:
    encoded = value.encode()
    return b"X" + struct.pack("<I", len(encoded)) + encoded


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _code(marker: Path) -> bytes:
    return _text(f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')")


DCP_METADATA = "torch.distributed.checkpoint.metadata"


def tricks(marker: Path) -> dict[str, bytes]:
    """Pickle opcodes that each push one value and, in a plain unpickler, run code or change the process
    (or try to: a lookup of a global no checkpoint needs is refused for itself)."""
    code = _code(marker)
    return {
        "REDUCE": _global("builtins", "eval") + code + b"\x85R",
        # BUILD with (None, {name: value}) sets attributes with setattr: on a class, it patches the class.
        "BUILD on a class": _global("pathlib", "PosixPath")
        + b"N}"
        + _text("is_file")
        + _global("pathlib", "PosixPath")
        + b"s\x86b",
        "BUILD dict state on a class": _global("pathlib", "PosixPath")
        + b"}"
        + _text("is_file")
        + _global("pathlib", "PosixPath")
        + b"sb",
        "BUILD on an allowed dataclass": _global(DCP_METADATA, "Metadata")
        + b"N}"
        + _text("version")
        + _text("patched")
        + b"s\x86b",
        "BUILD on an enum member": _global(DCP_METADATA, "_MEM_FORMAT_ENCODING")
        + b"K\x00\x85R}"
        + _text("_value_")
        + b"K\x07sb",
        "BUILD on a dtype": _global("torch", "float32") + b"}" + _text("is_signed") + b"\x88sb",
        "GLOBAL not allowed": _global("os", "system"),
        "GLOBAL of an attribute path": _text("pathlib") + _text("PosixPath.is_file.__globals__") + b"\x93",
        "STACK_GLOBAL": _text("builtins") + _text("eval") + b"\x93" + code + b"\x85R",
        "STACK_GLOBAL of computed names": b")" + _text("eval") + b"\x93",
        "INST": b"(" + code + b"ibuiltins\neval\n",
        "OBJ": b"(" + _global("builtins", "eval") + code + b"o",
        "EXT1": b"\x82\xf0" + code + b"\x85R",
        "EXT2": b"\x83" + struct.pack("<H", 0x1F0) + code + b"\x85R",
        "EXT4": b"\x84" + struct.pack("<i", 0x1FFF0) + code + b"\x85R",
        "PERSID": b"Pstorage\n",
        "BINPERSID": _text("storage") + b"Q",
        "NEWOBJ_EX": _global("pathlib", "PosixPath") + b")}\x92",
    }


NAMES = list(tricks(Path("x")))


def _process_state() -> dict:
    """What the tricks would change if they got through."""
    member = dcp_metadata._MEM_FORMAT_ENCODING(0)
    return {
        "PosixPath.is_file": vars(pathlib.PosixPath).get("is_file", pathlib.Path.is_file),
        "Metadata.version": vars(dcp_metadata.Metadata).get("version"),
        "enum": member._value_,
        "float32 is_signed": torch.float32.is_signed,
    }


def _with_trick(pickled: bytes, trick: bytes) -> bytes:
    """`pickled` (protocol 2) with the placeholder string's opcode replaced by the trick."""
    assert pickled.count(_text(PLACEHOLDER)) == 1
    return pickled.replace(_text(PLACEHOLDER), trick)


# ----------------------------------------------------------------------------- files to put tricks into


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    """A complete step folder of this tool: weights, a non-tensor value, checksums, COMPLETE."""
    folder = tmp_path_factory.mktemp("ckpt") / "step_4"
    start_marker(folder)
    dcp.save(
        {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 4, "note": "plain"}},
        storage_writer=ChecksummingWriter(str(folder)),
        no_dist=True,
    )
    write_marker(folder, {"step": 4, "metrics": {}})
    return folder


def _crafted_metadata(step_dir: Path, trick: bytes) -> bytes:
    """The folder's real index with one string replaced by the trick: everything else is valid metadata."""
    index = load_index((step_dir / ".metadata").read_bytes())
    index.storage_meta.modules = [PLACEHOLDER]
    import pickle

    return _with_trick(pickle.dumps(index, protocol=2), trick)


def _torch_file(trick: bytes) -> bytes:
    """A torch.save zip whose data.pkl holds the trick beside real weights."""
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2)}, "note": PLACEHOLDER}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for name in source.namelist():
            data = source.read(name)
            target.writestr(name, _with_trick(data, trick) if name.endswith("data.pkl") else data)
    return out.getvalue()


def _load_metadata_of_complete_folder(step_dir: Path, trick: bytes, tmp: Path) -> None:
    target = tmp / "step_4"
    shutil.copytree(step_dir, target)
    (target / ".metadata").write_bytes(_crafted_metadata(step_dir, trick))
    (target / "COMPLETE").unlink()
    (target / "index.json").unlink(missing_ok=True)  # the pickle index is read
    write_marker(target, {"step": 4, "metrics": {}})  # the attacker makes the marker match
    verify(target)


def _load_metadata_of_plain_dcp_folder(step_dir: Path, trick: bytes, tmp: Path) -> None:
    target = tmp / "plain"
    shutil.copytree(step_dir, target)
    (target / "COMPLETE").unlink()
    (target / ".metadata").write_bytes(_crafted_metadata(step_dir, trick))
    verify_plain_dcp(target)


class _RawValuePlanner(DefaultSavePlanner):
    """Writes `raw` as the bytes of every non-tensor value (DCP's own planner writes torch.save of the value)."""

    def __init__(self, raw: bytes):
        super().__init__()
        self.raw = raw

    def resolve_data(self, write_item):
        return io.BytesIO(self.raw) if write_item.type == WriteItemType.BYTE_IO else super().resolve_data(write_item)


def _load_a_value_from_a_shard(step_dir: Path, trick: bytes, tmp: Path) -> None:
    target = tmp / "values"
    dcp.save(
        {"train_state": {"step": 0}},
        checkpoint_id=str(target),
        planner=_RawValuePlanner(_torch_file(trick)),
        no_dist=True,
    )
    state = {"train_state": {"step": 0}}
    dcp.load(state, storage_reader=SafeReader(str(target)), planner=SafeLoadPlanner(), no_dist=True)


def _load_a_torch_weights_file(step_dir: Path, trick: bytes, tmp: Path) -> None:
    (tmp / "weights.pt").write_bytes(_torch_file(trick))
    load_weights_file(tmp / "weights.pt")


def _load_hf_pytorch_model_bin(step_dir: Path, trick: bytes, tmp: Path) -> None:
    (tmp / "hf").mkdir()
    (tmp / "hf" / "pytorch_model.bin").write_bytes(_torch_file(trick))
    read_hf_weights(tmp / "hf")


READERS = {
    "metadata of a step folder": _load_metadata_of_complete_folder,
    "metadata of a plain DCP folder": _load_metadata_of_plain_dcp_folder,
    "value in a .distcp shard": _load_a_value_from_a_shard,
    "torch weights file": _load_a_torch_weights_file,
    "HF pytorch_model.bin": _load_hf_pytorch_model_bin,
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("name", NAMES)
def test_every_trick_is_refused_on_every_reader_and_changes_nothing(step_dir, tmp_path, reader, name):
    marker = tmp_path / "ran"
    before = _process_state()
    with pytest.raises(BaseException) as refused:  # CheckpointError, ValueError, or DCP's CheckpointException
        READERS[reader](step_dir, tricks(marker)[name], tmp_path)
    assert not isinstance(refused.value, (KeyboardInterrupt, SystemExit, AssertionError))
    message = str(refused.value)
    assert any(word in message for word in ("refusing", "not plain data", "Unsupported", "cannot read")), message
    assert not marker.exists(), f"{name} ran code through the {reader}"
    assert _process_state() == before, f"{name} changed the process through the {reader}"


def test_the_crafted_files_are_otherwise_valid(step_dir, tmp_path):
    """Without a trick (the placeholder string kept), each crafted file loads: a refusal above is the trick's. (The
    HF reader then refuses the file's shape, a nested state dict with a note, after unpickling it.)"""
    plain = _text(PLACEHOLDER)
    for reader in READERS.values():
        folder = tmp_path / reader.__name__
        folder.mkdir()
        if reader is _load_hf_pytorch_model_bin:
            with pytest.raises(ValueError, match="not a state dict"):
                reader(step_dir, plain, folder)
        else:
            reader(step_dir, plain, folder)


# A plain unpickler, in a process of its own: each trick does what it says (the process is put back after each).
_CONTROL = """
import copyreg, json, pathlib, pickle, sys
from torch.distributed.checkpoint import metadata as dcp_metadata
for code in (0xF0, 0x1F0, 0x1FFF0):  # the extension codes the EXT tricks use, as a process might register them
    copyreg._inverted_registry[code] = ("builtins", "eval")
member, version = dcp_metadata._MEM_FORMAT_ENCODING(0), vars(dcp_metadata.Metadata).get("version")
done = {}
for name, (payload, marker) in json.loads(sys.stdin.read()).items():
    pickle.loads(b"\\x80\\x02" + bytes.fromhex(payload) + b".")
    done[name] = {"ran": pathlib.Path(marker).exists(),
                  "patched": [vars(pathlib.PosixPath).get("is_file") is pathlib.PosixPath,
                              vars(dcp_metadata.Metadata).get("version") == "patched", member._value_ == 7]}
    if "is_file" in vars(pathlib.PosixPath):
        delattr(pathlib.PosixPath, "is_file")
    dcp_metadata.Metadata.version, member._value_ = version, 0
print(json.dumps(done))
"""

CODE_RUNNING = ["REDUCE", "STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"]
PATCHING = {"BUILD on a class": 0, "BUILD on an allowed dataclass": 1, "BUILD on an enum member": 2}


def test_control_a_plain_unpickler_falls_for_the_tricks(tmp_path):
    markers = {name: tmp_path / name.replace(" ", "_") for name in CODE_RUNNING + list(PATCHING)}
    payloads = {name: (tricks(marker)[name].hex(), str(marker)) for name, marker in markers.items()}
    result = subprocess.run(
        [sys.executable, "-c", _CONTROL], input=json.dumps(payloads), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(done[name]["ran"] for name in CODE_RUNNING), done
    assert all(done[name]["patched"][which] for name, which in PATCHING.items()), done


# Globals PyTorch's weights_only unpickler allows by default that a DCP index never holds: refused in an index
# before they are built (bytearray and torch.Tensor allocate what the file asks for; _codecs.encode imports).
INDEX_ONLY = {
    "bytearray": _global("builtins", "bytearray") + b"K\x10\x85R",
    "torch.Tensor": _global("torch", "Tensor") + b"K\x10\x85R",
    "_codecs.encode": _global("_codecs", "encode") + _text("abc") + _text("rot13") + b"\x86R",
    "Counter": _global("collections", "Counter") + b")R",
    "STACK_GLOBAL bytearray": _text("builtins") + _text("bytearray") + b"\x93K\x10\x85R",
}


@pytest.mark.parametrize("name", list(INDEX_ONLY))
def test_an_index_names_only_the_globals_an_index_holds(step_dir, tmp_path, name):
    with pytest.raises(CheckpointError, match="is not one a DCP index holds"):
        _load_metadata_of_complete_folder(step_dir, INDEX_ONLY[name], tmp_path)


# The same globals in a value of a .distcp shard (PyTorch's weights_only defaults allow them): refused before
# the unpickler builds them, so a ~1 KB value cannot make the process allocate 4 GiB.
VALUE_ALLOCATING = {
    "bytearray": _global("builtins", "bytearray") + b"\x8a\x05\x00\x00\x00\x00\x01\x85R",  # bytearray(2**32)
    "torch.Tensor": _global("torch", "Tensor") + b"\x8a\x05\x00\x00\x00\x00\x01\x85R",
    "STACK_GLOBAL bytearray": _text("builtins") + _text("bytearray") + b"\x93\x8a\x05\x00\x00\x00\x00\x01\x85R",
    "Counter": _global("collections", "Counter") + b")R",
}

_PEAK_RSS = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from tests.unit.checkpointing.test_restricted_unpickling import VALUE_ALLOCATING, _load_a_value_from_a_shard
from pathlib import Path
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the imports' peak, whatever this machine makes it
try:
    _load_a_value_from_a_shard(None, VALUE_ALLOCATING[sys.argv[3]], Path(sys.argv[2]))
except BaseException as e:  # DCP's CheckpointException is a BaseException
    print("refused:", " ".join(str(e).split()))
print("peak_rise_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "after_imports_kib", before)
"""


@pytest.mark.parametrize("name", list(VALUE_ALLOCATING))
def test_a_value_names_only_the_globals_plain_data_is_saved_with(tmp_path, name):
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(pathlib.Path(__file__).parents[3]), str(tmp_path), name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and "is not one plain data is saved with" in lines[0], lines
    assert "refusing to load the value 'train_state.step'" in lines[0], lines
    # KiB: what writing and loading the shard added to the process's peak is nothing near the 4 GiB asked for
    assert int(lines[-1].split()[1]) < 1024 * 1024, lines
