"""No small file costs gigabytes or minutes before it is refused: every pickle a checkpoint load reads passes one
guard first (core/checkpointing/pickle_guard.py), and what passes still loads.

The crafted files are those that took the machine before the guard: a 1.4 KB value of a `.distcp` shard whose nested
lists share references through the pickle memo (on resume), a .pt under 1 KB whose pickle is `bytearray(2**32)`
(checkpoint.init_from, `checkpoint.py from-torch`, `from-hf` of a folder with `pytorch_model.bin`), a `.metadata`
whose entries share one list of chunks (init_from and resume: quadratic time), torch files whose storages
claim more than the file holds (a compressed record, the legacy format's sizes, a tensor item of a shard), and weight
files whose tensors are many full views of one storage. Each
load of a crafted file runs in a process with a memory ceiling (tests/support/memory_capped.py: 2 GiB above what it has
mapped at its start), so that code which allocates what the file asks for fails fast instead of taking the
machine; its peak resident size is compared with that of the same command on a clean file."""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from core.checkpointing.layout import write_marker
from core.checkpointing.storage import ChecksummingWriter
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import run_python, train_run, validated_config

CEILING_MIB = 2048  # what a child may map beyond its start (tests/support/memory_capped.py)
MARGIN_KIB = 300 * 1024  # a refused load's peak may exceed the clean command's by this much at most
BYTEARRAY_4GIB = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x00\x01\x85R."  # bytearray(2**32)


def shared_lists(depth: int) -> list:
    """x0 = []; x(k+1) = [x_k, x_k]: depth + 1 lists in memory and in a pickle, 2**(depth+1) - 1 copied out."""
    lists: list = []
    for _ in range(depth):
        lists = [lists, lists]
    return lists


def torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def with_data_pkl(archive: bytes, pickled: bytes) -> bytes:
    """A torch.save archive with its data.pkl replaced by `pickled` (every other entry kept)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for name in source.namelist():
            target.writestr(name, pickled if name.endswith("/data.pkl") else source.read(name))
    return out.getvalue()


def bytearray_pt() -> bytes:
    """A .pt of less than 1 KB whose pickle is bytearray(2**32)."""
    return with_data_pkl(torch_saved({"w": torch.zeros(2)}), BYTEARRAY_4GIB)


def run_capped(report: Path, *argv: str, timeout: float = 600):
    """`python <argv>` under the memory ceiling: (the finished process, its peak resident KiB)."""
    proc = run_python("tests/support/memory_capped.py", str(report), str(CEILING_MIB), *argv, timeout=timeout)
    assert report.exists(), f"exit code {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
    return proc, json.loads(report.read_text())["peak_kib"]


def error_line(proc) -> str:
    """The one line an entry point shows for a refused file (train.py logs it, checkpoint.py prints `error: ...`),
    without a traceback."""
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if re.match(r"(.*\[ERROR\] - checkpoint )?error: ", line)]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """step_4 of a tiny run (weights, optimizer, scheduler, train state, RNG)."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = validated_config(
        "vit_sanity", TINY + [f"checkpoint.path={tmp}/ckpt", "training.steps=4", "checkpoint.save_every_n_steps=4"]
    )
    train_run(cfg, tmp / "run")
    return tmp / "ckpt" / "step_4"


class _ReplacingPlanner(DefaultSavePlanner):
    """Writes `raw[fqn]` as the bytes of the value `fqn` (DCP's own planner writes torch.save of the value)."""

    def __init__(self, raw: dict[str, bytes]):
        super().__init__()
        self.raw = raw

    def resolve_data(self, write_item):
        if write_item.index.fqn in self.raw:
            return io.BytesIO(self.raw[write_item.index.fqn])
        return super().resolve_data(write_item)


def resaved(source: Path, target: Path, raw: dict[str, bytes]) -> Path:
    """The step folder `source` written again as `target`, as anyone can write one (checksums and marker made to
    match), with the bytes of the values in `raw` replaced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    full = target.parent / f"{target.name}.full.pt"
    dcp_to_torch_save(str(source), str(full))
    state = torch.load(full, weights_only=False)  # this test's own checkpoint
    full.unlink()
    dcp.save(state, storage_writer=ChecksummingWriter(str(target)), planner=_ReplacingPlanner(raw), no_dist=True)
    shutil.copy(source / "config.yaml", target / "config.yaml")
    write_marker(target, {"step": 4, "metrics": {}})
    return target


# ----------------------------------------------------------------------------- 1: a value that copying expands


@pytest.mark.slow
def test_a_value_of_shared_lists_is_refused_on_resume_before_it_is_copied(trained, tmp_path):
    crafted = resaved(trained, tmp_path / "crafted" / "step_4", {"train_state.step": torch_saved(shared_lists(23))})
    clean = resaved(trained, tmp_path / "clean" / "step_4", {})
    runs = {}
    for name, root in (("clean", clean.parent), ("crafted", crafted.parent)):
        runs[name] = run_capped(
            tmp_path / f"{name}.json",
            "train.py",
            "--config-name",
            "vit_sanity",
            *TINY,
            f"checkpoint.path={root}",
            "training.steps=6",
            f"hydra.run.dir={tmp_path}/{name}_run",
        )
    assert runs["clean"][0].returncode == 0, runs["clean"][0].stderr[-3000:]
    proc, peak = runs["crafted"]
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = error_line(proc)
    assert str(crafted) in line and "train_state.step" in line and "shares one list at least" in line, line
    print(f"peak {peak} KiB, clean {runs['clean'][1]} KiB")
    assert peak <= runs["clean"][1] + MARGIN_KIB, (peak, runs["clean"][1])


# ----------------------------------------------------------------------------- 2: weights files that allocate


def _hf_folder(folder: Path, weights: bytes) -> Path:
    from recipes.gpt.hf import llama_config
    from tests.unit.config.test_file_shape import SETTINGS

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama_config(SETTINGS, SETTINGS["vocab_size"], {}, "float32")))
    (folder / "pytorch_model.bin").write_bytes(weights)
    return folder


def _llama_weights() -> bytes:
    from recipes.gpt.hf import llama_shapes
    from tests.unit.config.test_file_shape import SETTINGS

    return torch_saved({name: torch.zeros(shape) for name, shape in llama_shapes(SETTINGS).items()})


WEIGHT_READERS = {
    "init_from": lambda tmp, pt: (
        "train.py",
        "--config-name",
        "vit_sanity",
        *TINY,
        "training.steps=2",
        f"checkpoint.init_from={pt}",
        f"checkpoint.path={tmp}/ckpt",
        f"hydra.run.dir={tmp}/run",
    ),
    "from-torch": lambda tmp, pt: ("checkpoint.py", "from-torch", str(pt), str(tmp / "step_0")),
    "from-hf": lambda tmp, folder: ("checkpoint.py", "from-hf", str(folder), str(tmp / "out.safetensors")),
}


@pytest.mark.slow
@pytest.mark.parametrize("reader", list(WEIGHT_READERS))
def test_a_weights_file_whose_pickle_allocates_is_refused_unbuilt(trained, tmp_path, reader):
    runs = {}
    for name in ("clean", "crafted"):
        tmp = tmp_path / name
        tmp.mkdir()
        if reader == "from-hf":
            source = _hf_folder(tmp / "hf", _llama_weights() if name == "clean" else bytearray_pt())
            file = source / "pytorch_model.bin"
        else:
            file = source = tmp / "weights.pt"
            if name == "clean":
                import checkpoint

                checkpoint.main(["to-torch", str(trained), str(file)])
            else:
                file.write_bytes(bytearray_pt())
        runs[name] = run_capped(tmp_path / f"{name}.json", *WEIGHT_READERS[reader](tmp, source))
    assert runs["clean"][0].returncode == 0, runs["clean"][0].stderr[-3000:]
    proc, peak = runs["crafted"]
    # A checkpoint to fix: 3 (train.py, checkpoint.py from-torch); a Hugging Face folder is another input: 2.
    assert proc.returncode == (2 if reader == "from-hf" else 3), proc.stderr[-3000:]
    line = error_line(proc)
    assert str(file) in line and "global builtins.bytearray at byte 2 is not one plain data is saved with" in line, line
    if reader != "init_from":
        assert line.startswith("error: "), line
    assert len(bytearray_pt()) < 1024
    print(f"peak {peak} KiB, clean {runs['clean'][1]} KiB")
    assert peak <= runs["clean"][1] + MARGIN_KIB, (peak, runs["clean"][1])


@pytest.mark.slow
def test_a_weights_file_whose_tensor_claims_more_than_its_storage_is_refused_uncopied(tmp_path):
    """A 1.5 KB pytorch_model.bin whose extra bfloat16 tensor is one element broadcast to 2**15 x 2**15 (stride 0):
    from-hf makes every float tensor fp32 before it compares names and shapes, 4 GiB for this one."""
    weights = torch.load(io.BytesIO(_llama_weights()), weights_only=True)
    crafted = {**weights, "junk": torch.zeros(1, dtype=torch.bfloat16).expand(2**15, 2**15)}
    runs = {}
    for name, state in (("clean", weights), ("crafted", crafted)):
        (tmp_path / name).mkdir()
        folder = _hf_folder(tmp_path / name / "hf", torch_saved(state))
        runs[name] = run_capped(
            tmp_path / f"{name}.json", "checkpoint.py", "from-hf", str(folder), str(tmp_path / name / "out.safetensors")
        )
    assert runs["clean"][0].returncode == 0, runs["clean"][0].stderr[-3000:]
    proc, peak = runs["crafted"]
    line = error_line(proc)
    assert proc.returncode == 2 and line == (
        f"error: {folder / 'pytorch_model.bin'}: refusing to load it: 'junk' is a "
        "view of 1,073,741,824 elements over a storage of 1; nothing was imported"
    ), line
    print(f"peak {peak} KiB, clean {runs['clean'][1]} KiB")
    assert peak <= runs["clean"][1] + MARGIN_KIB, (peak, runs["clean"][1])


def _read_weights(reader: str, tmp_path: Path, state: dict) -> tuple[Path, dict]:
    """`state` saved as a .pt (from-torch, init_from) or a folder's pytorch_model.bin (from-hf), and read back."""
    from core.checkpointing.hf_folders import read_hf_weights
    from core.checkpointing.weights import load_weights_file

    if reader == "from-torch":
        torch.save(state, tmp_path / "w.pt")
        return tmp_path / "w.pt", load_weights_file(tmp_path / "w.pt")
    torch.save(state, tmp_path / "pytorch_model.bin")
    return tmp_path / "pytorch_model.bin", read_hf_weights(tmp_path)


@pytest.mark.parametrize("reader", ["from-torch", "from-hf"])
def test_a_weights_file_of_many_views_of_one_storage_is_refused_uncopied(tmp_path, reader):
    """50 full-size views of one 128 KiB storage: torch.save keeps the storage once, so the file is ~130 KB, but
    each view passes beyond_its_storage and copying them out (from-hf's fp32, from-torch's step folder) costs 50 x the
    storage. Tied weights (an embedding and a head of one storage) and distinct tensors still load."""
    from core.checkpointing.layout import CheckpointError

    base = torch.zeros(256, 128)
    with pytest.raises((CheckpointError, ValueError)) as refused:
        _read_weights(reader, tmp_path, {f"w{i}": base.view(128, 256) for i in range(50)})
    file = tmp_path / ("w.pt" if reader == "from-torch" else "pytorch_model.bin")
    assert str(refused.value).startswith(
        f"{file}: refusing to load it: its 50 tensors hold 6,553,600 bytes, over storages of 131,072 bytes in all"
    ), refused.value
    tied = {"embed.weight": base, "head.weight": base, "norm.weight": torch.ones(128), "layer.weight": torch.ones(8, 8)}
    _, loaded = _read_weights(reader, tmp_path, tied)
    assert loaded["embed.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    assert _same(loaded, tied)


def _claiming(archive: bytes, numel: int) -> bytes:
    """A torch.save archive of {"w": torch.zeros(2)} whose storage claims `numel` elements."""
    pickled = zipfile.ZipFile(io.BytesIO(archive)).read("archive/data.pkl")
    assert pickled.count(b"K\x02tq") == 1  # the storage's element count, closing its persistent id
    return with_data_pkl(archive, pickled.replace(b"K\x02tq", b"J" + struct.pack("<i", numel) + b"tq"))


def _deflated(numel: int) -> bytes:
    """A ~0.5 MB .pt whose one storage is `numel` float zeros, deflated (torch inflates the records it reads)."""
    zeros = bytes(1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    packed = b"".join(compressor.compress(zeros) for _ in range(numel * 4 >> 20)) + compressor.flush()
    crc = 0
    for _ in range(numel * 4 >> 20):
        crc = zlib.crc32(zeros, crc)
    pickled = zipfile.ZipFile(io.BytesIO(_claiming(torch_saved({"w": torch.zeros(2)}), numel))).read("archive/data.pkl")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        target.writestr("archive/data.pkl", pickled)
        target.writestr("archive/byteorder", "little")
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        target.writestr(info, b"")  # replaced below: an entry of the record's real sizes
        target.writestr("archive/version", "3\n")
    return _with_record(out.getvalue(), "archive/data/0", packed, numel * 4, crc)


def _with_record(archive: bytes, name: str, packed: bytes, size: int, crc: int) -> bytes:
    """`archive` written again with the entry `name` holding `packed` (deflated), of `size` bytes unpacked."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out, directory = io.BytesIO(), []
    for info in source.infolist():
        data = packed if info.filename == name else source.read(info.filename)
        unpacked, data_crc = (size, crc) if info.filename == name else (len(data), zlib.crc32(data))
        method = zipfile.ZIP_DEFLATED if info.filename == name else zipfile.ZIP_STORED
        encoded = info.filename.encode()
        fields = (method, 0, 0, data_crc, len(data), unpacked, len(encoded))
        directory.append((fields, out.tell(), encoded))
        out.write(struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, *fields, 0) + encoded + data)
    start = out.tell()
    for fields, header_at, encoded in directory:
        out.write(struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, *fields, 0, 0, 0, 0, 0, header_at) + encoded)
    count = len(directory)
    out.write(struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, count, count, out.tell() - start, start, 0))
    return out.getvalue()


def legacy_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def legacy_claiming(numel: int) -> bytes:
    """A legacy-format .pt of {"w": torch.zeros(2)} whose storage claims `numel` elements in its pickle."""
    data = legacy_saved({"w": torch.zeros(2)})
    assert data.count(b"K\x02Ntq") == 1  # the element count, then no view, closing the persistent id
    return data.replace(b"K\x02Ntq", b"J" + struct.pack("<i", numel) + b"Ntq")


def legacy_bytearray() -> bytes:
    """A legacy-format .pt whose object pickle is bytearray(2**32)."""
    headers = legacy_saved({})
    keys = pickle.dumps([], protocol=2)
    assert headers.endswith(b"}q\x00." + keys)  # the three header pickles, {}, []
    return headers[: -len(b"}q\x00." + keys)] + BYTEARRAY_4GIB + keys


CLAIMS = {
    "a deflated record": (lambda: _deflated(128 << 20), "archive/data/0 is compressed"),
    "a legacy storage claiming 2**31 floats": (lambda: legacy_claiming(2**31 - 1), "claims 2,147,483,647 elements"),
    "a legacy bytearray(2**32)": (legacy_bytearray, "global builtins.bytearray at byte 141 is not one"),
}

_LOAD = """
import sys
from pathlib import Path
from core.checkpointing.weights import load_weights_file
try:
    print("loaded", len(load_weights_file(Path(sys.argv[1]))))
except Exception as e:
    print("refused:", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLAIMS))
def test_a_torch_file_whose_storage_claims_more_than_it_holds_is_refused_unallocated(tmp_path, name):
    make, refusal = CLAIMS[name]
    crafted = tmp_path / "crafted.pt"
    crafted.write_bytes(make())
    assert crafted.stat().st_size < 1 << 20
    (tmp_path / "clean.pt").write_bytes(torch_saved({"w": torch.zeros(2)}))
    (tmp_path / "load.py").write_text(_LOAD)
    clean, clean_peak = run_capped(tmp_path / "clean.json", str(tmp_path / "load.py"), str(tmp_path / "clean.pt"))
    assert clean.stdout.strip() == "loaded 1", clean.stdout + clean.stderr[-3000:]
    proc, peak = run_capped(tmp_path / "crafted.json", str(tmp_path / "load.py"), str(crafted))
    assert proc.stdout.startswith(f"refused: {crafted}: refusing to load it: ") and refusal in proc.stdout, (
        proc.stdout + proc.stderr[-3000:]
    )
    print(f"{name}: peak {peak} KiB, clean {clean_peak} KiB")
    assert peak <= clean_peak + MARGIN_KIB, (peak, clean_peak)


def _replace_item_pickle(shard: Path, item_at: int, item_length: int, pickled: bytes) -> None:
    """Put `pickled` (padded to the same length: an unpickler stops at STOP) in place of the data.pkl of the
    torch.save archive at [item_at, item_at + item_length) of `shard`, with its CRC-32s to match."""
    data = bytearray(shard.read_bytes())
    item = zipfile.ZipFile(io.BytesIO(bytes(data[item_at : item_at + item_length])))
    info = next(i for i in item.infolist() if i.filename.endswith("/data.pkl"))
    assert len(pickled) <= info.file_size
    padded = pickled + b"\x00" * (info.file_size - len(pickled))
    header = item_at + info.header_offset
    name_length, extra_length = struct.unpack_from("<2H", data, header + 26)
    start = header + 30 + name_length + extra_length
    data[start : start + len(padded)] = padded
    crc = zlib.crc32(padded)
    struct.pack_into("<I", data, header + 14, crc)
    directory = data.find(b"PK\x01\x02" + data[header + 4 : header + 6], item_at)
    while struct.unpack_from("<I", data, directory + 42)[0] != info.header_offset:
        directory = data.find(b"PK\x01\x02", directory + 4)
    struct.pack_into("<I", data, directory + 16, crc)
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_tensor_item_of_a_shard_whose_pickle_allocates_is_refused_before_dcp_reads_it(trained, tmp_path):
    from core.checkpointing.layout import verify

    crafted = tmp_path / "crafted"
    shutil.copytree(trained, crafted)
    metadata = verify(crafted)
    where, info = next((w, i) for w, i in metadata.storage_data.items() if w.fqn.startswith("model."))
    _replace_item_pickle(crafted / info.relative_path, info.offset, info.length, BYTEARRAY_4GIB)
    write_marker(crafted, {"step": 4, "metrics": {}})  # the attacker makes the marker match
    runs = {
        name: run_capped(
            tmp_path / f"{name}.json", "checkpoint.py", "to-torch", str(folder), str(tmp_path / f"{name}.pt")
        )
        for name, folder in (("clean", trained), ("crafted", crafted))
    }
    assert runs["clean"][0].returncode == 0, runs["clean"][0].stderr[-3000:]
    proc, peak = runs["crafted"]
    line = error_line(proc)
    assert proc.returncode == 3 and line.startswith(f"error: {crafted}: loading failed "), line
    assert (
        f"refusing to load the tensor {where.fqn!r} ({info.relative_path} at byte {info.offset}): global "
        "builtins.bytearray at byte 2 is not one a saved tensor is built with"
    ) in line, line
    print(f"peak {peak} KiB, clean {runs['clean'][1]} KiB")
    assert peak <= runs["clean"][1] + MARGIN_KIB, (peak, runs["clean"][1])


# ----------------------------------------------------------------------------- 3: an index that costs quadratic time


def metadata_sharing_chunks(entries: int, chunks: int) -> bytes:
    """A DCP index whose `entries` tensors share one list of `chunks` valid chunks (DCP's default protocol)."""
    shared = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(chunks)]
    properties = TensorProperties(dtype=torch.float32)
    tensors = {
        f"w{i}": TensorStorageMetadata(properties=properties, size=torch.Size([chunks]), chunks=shared)
        for i in range(entries)
    }
    return pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data={}, storage_meta=StorageMeta()))


# 40,000 entries sharing one list of 1,000 chunks (a 1.6 MB file): 40 million chunk checks where the list is walked
# once per entry (minutes).
ENTRIES, CHUNKS = 40_000, 1_000

_TIMED = """
import sys, time
from pathlib import Path
from core.checkpointing.layout import verify, verify_plain_dcp
folder = Path(sys.argv[2])
start = time.perf_counter()
try:
    (verify_plain_dcp if sys.argv[1] == "init_from" else verify)(folder)
    print("read")
except Exception as e:
    print("refused:", e)
print(f"seconds {time.perf_counter() - start:.3f}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", ["init_from", "resume"])
def test_an_index_whose_entries_share_their_chunks_is_refused_in_linear_time(tmp_path, path):
    folder = tmp_path / "step_4"
    folder.mkdir()
    (folder / ".metadata").write_bytes(metadata_sharing_chunks(ENTRIES, CHUNKS))
    if path == "resume":  # a step folder of this tool written before index.json: its pickle index is read
        write_marker(folder, {"step": 4, "metrics": {}})
    (tmp_path / "timed.py").write_text(_TIMED)
    proc = run_python(str(tmp_path / "timed.py"), path, str(folder), timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[0].startswith("refused: "), proc.stdout + proc.stderr[-3000:]
    assert f"{folder / '.metadata'}: refusing to load it: a pickle that shares one list at least" in lines[0], lines
    seconds = float(lines[-1].split()[1])
    print(f"{path}: {(folder / '.metadata').stat().st_size} bytes refused in {seconds} s")
    assert seconds < 2, lines


@pytest.mark.slow
def test_init_from_an_index_whose_entries_share_their_chunks_is_one_line(tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(metadata_sharing_chunks(ENTRIES, CHUNKS))
    proc = run_python(
        "train.py",
        "--config-name",
        "vit_sanity",
        *TINY,
        f"checkpoint.init_from={folder}",
        f"checkpoint.path={tmp_path}/ckpt",
        f"hydra.run.dir={tmp_path}/run",
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"{folder / '.metadata'}: refusing to load it: a pickle that shares one list" in error_line(proc)


# ----------------------------------------------------------------------------- what passes still loads


def test_torch_files_as_written_load_through_the_guard(tmp_path):
    """Tied weights (one storage, two tensors), one tensor under two names, an optimizer's state beside the model
    (its param groups share one betas tuple), newer dtypes, a Parameter, views, and the legacy format."""
    from core.checkpointing.pickle_guard import load_torch_file

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight
    optimizer = torch.optim.AdamW(
        [{"params": [model[0].weight]}, {"params": [model[1].bias], "weight_decay": 0.0}], betas=(0.9, 0.95)
    )
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert state["param_groups"][0]["betas"] is state["param_groups"][1]["betas"]
    base = torch.arange(10.0)
    values = {
        "model": model.state_dict(),
        "optimizer": state,
        "twice": {"a": base, "b": base},
        "dtypes": {"u16": torch.ones(3, dtype=torch.uint16), "fp8": torch.ones(3, dtype=torch.float8_e4m3fn)},
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "views": {"slice": base[2:5], "expanded": base.expand(3, 10)},
        "plain": {"epoch": 3, "name": "run", "bytes": b"\x00\x01", "set": {1, 2}},
    }
    for name, value in values.items():
        for data in [torch_saved(value)] + ([legacy_saved(value)] if name != "dtypes" else []):  # (torch's limit)
            assert _same(load_torch_file(data), value), name
    # A legacy file saved from a GPU names the CUDA storage classes and the device: it loads onto the CPU.
    on_gpu = legacy_saved({"w": base}).replace(b"ctorch\nFloatStorage\n", b"ctorch.cuda\nFloatStorage\n")
    on_gpu = on_gpu.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
    assert b"torch.cuda" in on_gpu and b"cuda:0" in on_gpu and _same(load_torch_file(on_gpu), {"w": base})
    tied = load_torch_file(torch_saved(model.state_dict()))
    assert tied["0.weight"].untyped_storage().data_ptr() == tied["1.weight"].untyped_storage().data_ptr()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().flatten().contiguous().view(torch.uint8)


def _same(loaded, value) -> bool:
    if torch.is_tensor(value):
        return (
            type(loaded) is type(value)
            and loaded.dtype == value.dtype
            and loaded.shape == value.shape
            and loaded.stride() == value.stride()
            and torch.equal(_bytes_of(loaded), _bytes_of(value))
        )
    if isinstance(value, dict):
        return (
            type(loaded) is type(value)
            and loaded.keys() == value.keys()
            and all(_same(loaded[k], value[k]) for k in value)
        )
    if isinstance(value, (list, tuple)):
        return type(loaded) is type(value) and len(loaded) == len(value) and all(map(_same, loaded, value))
    return loaded == value


def _refusal(value_pickle: bytes) -> str:
    from core.checkpointing.pickle_guard import PLAIN_DATA_GLOBALS, UnsafeCheckpoint, check_pickle

    with pytest.raises(UnsafeCheckpoint) as refused:
        check_pickle(value_pickle, PLAIN_DATA_GLOBALS, [])
    return str(refused.value)


def test_shared_containers_are_counted_as_copied_out_whenever_they_are_filled():
    """Sharing is counted as the pickle goes (refused as soon as it is too much) and on the whole value at its
    end, so lists shared while empty and filled afterwards are refused too; a little sharing passes."""
    assert re.search(r"shares one list at least [\d,]+ times", _refusal(pickle.dumps(shared_lists(23), protocol=2)))
    pickled = pickle.dumps(shared_lists(10), protocol=2)  # 2047 lists: passes; the innermost is memo entry 10
    assert b"]q\nh\ne" in pickled and pickled.endswith(b".")
    # Then 60 numbers appended to the innermost list, which 2**10 references hold already; the value: (lists, innermost)
    message = _refusal(pickled[:-1] + b"h\n(" + b"K\x01" * 60 + b"e\x86.")
    assert "shares one list at least 1,025 times" in message, message
    from core.checkpointing.pickle_guard import PLAIN_DATA_GLOBALS, check_pickle

    check_pickle(pickled, PLAIN_DATA_GLOBALS, [])


def test_a_container_that_holds_itself_or_nests_too_deep_is_refused():
    from core.checkpointing.pickle_guard import MAX_DEPTH

    looped: list = []
    looped.append(looped)
    assert "a list that holds itself" in _refusal(pickle.dumps(looped, protocol=2))
    nested: list = []
    for _ in range(MAX_DEPTH + 5):
        nested = [nested]
    assert f"nested more than {MAX_DEPTH} containers deep" in _refusal(pickle.dumps(nested, protocol=2))


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_pytorch_model_bin_as_transformers_wrote_it_imports_as_its_safetensors(tmp_path, zipped):
    """transformers before safetensors: torch.save(model.state_dict()) as pytorch_model.bin (in the legacy format
    before torch 1.6), the tied embeddings two tensors of one storage. It imports (`from-hf`) as the same model
    saved as safetensors does."""
    import transformers
    from safetensors.torch import load_file

    from checkpoint import main as checkpoint_cli

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "safetensors")
    state = model.state_dict()
    storages = {state[name].untyped_storage().data_ptr() for name in ("lm_head.weight", "model.embed_tokens.weight")}
    assert len(storages) == 1
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(tmp_path / "safetensors" / "config.json", folder)
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
    checkpoint_cli(["from-hf", str(tmp_path / "safetensors"), str(tmp_path / "a.safetensors")])
    checkpoint_cli(["from-hf", str(folder), str(tmp_path / "b.safetensors")])
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_torch_file_whose_zip_header_asks_for_an_unreadable_version_is_refused():
    """One flipped bit in the version a central-directory record needs makes zipfile raise NotImplementedError, not
    BadZipFile; it is refused as any other malformed archive."""
    from core.checkpointing.pickle_guard import TENSOR_GLOBALS, UnsafeCheckpoint, check_torch_file

    data = bytearray(torch_saved({"w": torch.zeros(2)}))
    data[data.index(b"PK\x01\x02") + 6] ^= 0x40
    with pytest.raises(UnsafeCheckpoint, match=r"not a torch.save archive \(NotImplementedError: zip file version"):
        check_torch_file(io.BytesIO(bytes(data)), TENSOR_GLOBALS)
