"""The on-disk layout of checkpoints, and how a folder is judged complete and whole.

`<checkpoint.path>/step_<N>/` holds (the same for every backend, world size and layer implementation):
  model.<name>          weights by their names in the user's model (no wrapper prefix such as `module.`)
  optim.state.<name>.*  optimizer state keyed by those parameter names; optim.param_groups
  scheduler             the LR scheduler's state
  train_state.*         step, consumed_samples, epoch, skipped_steps, dataset_len, world_size, data_fingerprint
  rng.rank_<r>.*        python/numpy/torch/CUDA RNG states of rank r
  fp8.<module>.*        TransformerEngine's delayed-scaling FP8 state (scales and amax histories), which
                        Megatron-FSDP's state dict drops with the rest of TE's `_extra_state`
  .metadata, index.json DCP's index, as its pickle (for DCP and other tools) and as JSON (what this tool reads)
  config.yaml           the resolved config of the run (rank 0)
  SAVING                written first, by rank 0: the folder is a save of this tool in progress
  COMPLETE              written last, by rank 0, after every rank finished; lists every file's size and
                        CRC-32 (computed while writing: core/checkpointing/storage.py)
Everything DCP stores is a tensor or a plain value, never a pickled object, so
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch` output loads with torch.load's default
weights_only=True. A folder without COMPLETE (or whose files do not match it) is never resumed from.
Only folders this tool can tell are its own (COMPLETE, or SAVING with nothing but checkpoint files) are
ever deleted.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from core.checkpointing.dcp_index import INDEX_FILE, UnsafeCheckpoint, index_from_json, load_index
from core.checkpointing.storage import collect_checksums, file_crc32, is_checksum_sidecar, stored_plainly
from core.config.file_shape import read_small_file

STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")  # step_<N> as a save names it: no step_04, no other digits
# A step folder of this tool set aside (core/checkpointing/manager.py): step_<N>.superseded, -2, -3, ... for more.
SET_ASIDE = ".superseded"
SET_ASIDE_DIR = re.compile(r"^step_(0|[1-9][0-9]*)\.superseded(-[1-9][0-9]*)?$")
COMPLETE_MARKER = "COMPLETE"
MARKER_MAX_BYTES = 64 * 1024 * 1024  # a marker lists each file in some 60 bytes: room for a million files
SAVING_MARKER = "SAVING"
# What a save of this tool writes into a step folder (a folder holding anything else is not deleted).
_OWN_FILES = re.compile(
    r"^(\.metadata(\.tmp)?|index\.json(\.tmp)?|__\d+_\d+\.distcp|__\d+_checksums\.json(\.tmp)?|"
    r"config\.yaml|COMPLETE(\.tmp)?|SAVING)$",
    re.ASCII,
)

# DCP gathers every rank's failure into one CheckpointException, which derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model; names the path."""


def describe(error: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException) and getattr(error, "failures", None):
        failures = {rank: e[0] if isinstance(e, tuple) else e for rank, e in error.failures.items()}  # (error, frames)
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    return f"{type(error).__name__}: {error}"


def step_of(path: Path) -> Optional[int]:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[Path]:
    """Existing step_<N> folders under root, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if step_of(p) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def set_aside_name(path: Path) -> Path:
    """The name `path` is set aside under: step_<N>.superseded, or .superseded-2, -3, ...: a name no file has yet."""
    path = Path(path)
    candidate, n = path.with_name(path.name + SET_ASIDE), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}{SET_ASIDE}-{n}")
    return candidate


def set_aside_dirs(root: Path) -> list[tuple[int, Path]]:
    """Existing step_<N>.superseded[-k] folders under root (no symbolic links), with their steps, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := SET_ASIDE_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()
    ]
    return sorted(found, key=lambda entry: (entry[0], entry[1].name))


LAST = "last"  # <checkpoint.path>/last: the newest complete step folder under checkpoint.path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint as users name it: a step folder (or a file) as it is; a checkpoint root (a folder of step
    folders, i.e. a run's checkpoint.path) or `<root>/last`: the newest complete step folder under the root."""
    path = Path(path)
    root = path.parent if path.name == LAST and not path.exists() else path
    if root is path and not (root.is_dir() and not (root / ".metadata").exists() and step_dirs(root)):
        return path  # not a root: used as given (its use says what is wrong with it)
    complete = complete_checkpoints(root)
    if not complete:
        raise CheckpointError(f"{path}: no complete checkpoint under {root}")
    return complete[-1]


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file() and (Path(path) / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    return [p for p in step_dirs(root) if is_complete(p)]


def is_own_incomplete(path: Path) -> bool:
    """An interrupted save of this tool: SAVING is there, COMPLETE is not, and nothing but checkpoint files."""
    path = Path(path)
    return (
        (path / SAVING_MARKER).is_file()
        and not (path / COMPLETE_MARKER).is_file()
        and all(_OWN_FILES.match(p.name) and p.is_file() for p in path.iterdir())
    )


def is_own(path: Path) -> bool:
    """A step folder this tool wrote (complete, with a well-formed marker, or an interrupted save) holding nothing
    but the files a save writes: the only kind it ever deletes."""
    path = Path(path)
    if path.is_symlink():  # a link to a folder elsewhere is not this run's to delete
        return False
    if is_own_incomplete(path):
        return True
    if not is_complete(path) or not all(_OWN_FILES.match(p.name) and p.is_file() for p in path.iterdir()):
        return False
    try:
        read_marker(path)
    except CheckpointError:
        return False
    return True


def start_marker(folder: Path) -> None:
    Path(folder).mkdir(parents=True)
    (Path(folder) / SAVING_MARKER).write_text("a save in progress; COMPLETE is written when it is whole\n")


def write_marker(folder: Path, marker: dict[str, Any]) -> None:
    """Write COMPLETE atomically (whole or absent, never half), listing each file's size and CRC-32: those the
    ranks recorded while writing, the few small files rank 0 wrote itself by reading them. Then drop the
    per-rank checksum files and SAVING."""
    folder = Path(folder)
    recorded = collect_checksums(folder)
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in (COMPLETE_MARKER, SAVING_MARKER) and not is_checksum_sidecar(p.name):
            files[p.name] = {
                "size": p.stat().st_size,
                "crc32": recorded[p.name] if p.name in recorded else file_crc32(p),
            }
    tmp = folder / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps({**marker, "files": files}, indent=1))
    os.replace(tmp, folder / COMPLETE_MARKER)
    for p in folder.iterdir():
        if is_checksum_sidecar(p.name) or p.name == SAVING_MARKER:
            p.unlink()


def read_marker(path: Path) -> dict:
    """The completion marker of the step folder `path`, checked against the shape this tool writes; a
    CheckpointError naming the file otherwise (automatic resume then falls back to the checkpoint before)."""
    file = Path(path) / COMPLETE_MARKER
    try:
        marker = json.loads(read_small_file(file, MARKER_MAX_BYTES))
    except (OSError, ValueError, RecursionError) as e:  # (a UnicodeDecodeError is a ValueError)
        raise CheckpointError(f"{file}: unreadable completion marker ({type(e).__name__}: {e})") from None
    problem = _marker_problem(marker)
    named = STEP_DIR.match(Path(path).name) or SET_ASIDE_DIR.match(Path(path).name)
    if not problem and named and marker["step"] != int(named.group(1)):
        problem = f"step {marker['step']}, in the folder of step {named.group(1)}"
    if problem:
        raise CheckpointError(f"{file}: not a completion marker of this tool ({problem})")
    return marker


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _marker_problem(marker: Any) -> Optional[str]:
    """What is wrong with a parsed COMPLETE, or None. It holds {"step": N, "metrics": {name: number}, "files":
    {name: {"size": bytes, "crc32": CRC}}} (checkpoints written before checksums: {name: bytes})."""
    if not isinstance(marker, dict):
        return f"a JSON {type(marker).__name__}, expected an object"
    if not _is_count(marker.get("step")):
        return f"step={marker.get('step')!r}, expected a whole number >= 0"
    metrics = marker.get("metrics", {})
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
        for k, v in metrics.items()
    ):
        return "metrics: expected an object of numbers"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "files: expected an object listing every file, .metadata among them"
    for name, entry in files.items():
        if not _OWN_FILES.match(name) or name in (COMPLETE_MARKER, SAVING_MARKER):
            return f"files: {name!r} is not a file a save writes"
        if not (
            _is_count(entry)
            or (
                isinstance(entry, dict)
                and _is_count(entry.get("size"))
                and (entry.get("crc32") is None or (_is_count(entry["crc32"]) and entry["crc32"] < 2**32))
            )
        ):
            return f'files: {name!r}: {entry!r}, expected {{"size": bytes, "crc32": CRC-32}}'
    return None


def read_metadata(path: Path, data: Optional[bytes] = None) -> Metadata:
    """The DCP index of the folder `path` (from `data`, its bytes, when already read), read safely
    (core/checkpointing/dcp_index.py)."""
    file = Path(path) / ".metadata"
    if data is None and file.is_symlink():
        raise CheckpointError(f"{file}: a symbolic link; a checkpoint's files are its own")
    try:
        return load_index(file.read_bytes() if data is None else data)
    except OSError as e:
        raise CheckpointError(f"{file}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"{file}: {e}") from None


def _listed(marker: dict) -> dict[str, tuple[int, Optional[int]]]:
    """The marker's files: name -> (size, CRC-32 or None for checkpoints written before checksums)."""
    entries = marker.get("files", {})
    return {name: (e, None) if isinstance(e, int) else (e["size"], e.get("crc32")) for name, e in entries.items()}


def checksum_errors(path: Path, rank: int = 0, world_size: int = 1, threads: int = 8) -> list[str]:
    """Files of the complete checkpoint `path` whose bytes no longer match the CRC-32 recorded when they were
    written; this rank checks its share (every world_size-th file), in parallel threads."""
    path = Path(path)
    listed = sorted((name, crc) for name, (_, crc) in _listed(read_marker(path)).items() if crc is not None)
    mine = listed[rank::world_size]

    def check(entry: tuple[str, int]) -> Optional[str]:
        name, crc = entry
        try:
            actual = file_crc32(path / name)
        except OSError as e:
            return f"{path / name}: unreadable ({e})"
        return None if actual == crc else f"{path / name}: checksum mismatch (the file changed after it was written)"

    with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
        return [error for error in pool.map(check, mine) if error]


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def verify(path: Path) -> Metadata:
    """Check that `path` is a complete checkpoint whose files are all there, whole; return its metadata.

    Catches interrupted saves (no marker), malformed markers, missing and truncated files, naming the file.
    The index (.metadata) is compared with its size and CRC-32 in the marker before it is parsed.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / COMPLETE_MARKER).is_file():
        if (path / ".metadata").is_file() and not (path / SAVING_MARKER).exists():
            raise CheckpointError(
                f"{path}: a DCP folder without a {COMPLETE_MARKER} marker (not a training checkpoint "
                "of this tool, e.g. format_utils torch_to_dcp output): it can be used as "
                "checkpoint.init_from (weights only), not resumed from"
            )
        if (path / "config.json").is_file() and any((path / f).is_file() for f in HF_WEIGHT_FILES):
            raise CheckpointError(
                f"{path}: a Hugging Face model folder, not a checkpoint of this tool: convert it with "
                f"python checkpoint.py from-hf {path} <out.safetensors>, then use that"
            )
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE_MARKER} marker: its save was interrupted)")
    listed = _listed(read_marker(path))
    for name, (size, _) in listed.items():
        file = path / name
        if file.is_symlink():
            raise CheckpointError(f"{file}: a symbolic link; a checkpoint's files are its own")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {COMPLETE_MARKER})")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, but {size} were written (truncated or changed)"
            )
    # The index as JSON where the save wrote one (no pickle read at all), else DCP's pickle, read safely; either
    # compared with its size and CRC-32 in the marker first.
    name = INDEX_FILE if INDEX_FILE in listed else ".metadata"
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path / name}: unreadable ({type(e).__name__}: {e})") from None
    size, crc = listed[name]
    if len(data) != size or (crc is not None and zlib.crc32(data) != crc):
        raise CheckpointError(f"{path / name}: checksum mismatch (the file changed after it was written); not read")
    if name == INDEX_FILE:
        try:
            metadata = index_from_json(data)
        except UnsafeCheckpoint as e:
            raise CheckpointError(f"{path / name}: {e}") from None
    else:
        metadata = read_metadata(path, data)
    check_storage(path, metadata, listed, index_name=name)
    return metadata


def check_storage(path: Path, metadata: Metadata, listed: Optional[dict] = None, index_name: str = ".metadata") -> None:
    """Every file the DCP index points into is a file of the folder (no symbolic link; listed in COMPLETE,
    when `listed` is given) and long enough; every tensor's chunks hold all of its elements once, each chunk's
    storage at least its bytes, and every item is a torch.save archive with its entries stored uncompressed
    (so nothing loaded is larger than the data on disk, or left partly unread)."""
    storage = metadata.storage_data
    index = Path(path) / index_name  # the file the index was read from, named in every message
    for where, info in storage.items():
        file = Path(path) / info.relative_path
        if listed is not None and info.relative_path not in listed:
            raise CheckpointError(f"{index}: points into {info.relative_path}, which {COMPLETE_MARKER} does not list")
        if file.is_symlink():
            raise CheckpointError(f"{file}: a symbolic link; a checkpoint's files are its own")
        if not file.is_file() or file.stat().st_size < info.offset + info.length:
            raise CheckpointError(
                f"{file}: missing or truncated (DCP metadata expects >= {info.offset + info.length} bytes)"
            )
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        overlap = _overlap(entry)
        if overlap is None:
            raise CheckpointError(f"{index}: {key} is split into more pieces than can be checked")
        if sum(math.prod(chunk.sizes) for chunk in entry.chunks) != math.prod(entry.size) or overlap:
            raise CheckpointError(
                f"{index}: the chunks of {key} do not hold its {math.prod(entry.size)} elements (each once)"
            )
        itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{index}: {key} has a chunk with no storage")
            if info.length < math.prod(chunk.sizes) * itemsize:
                raise CheckpointError(f"{index}: {key} claims more bytes than its storage holds")
    by_file: dict[str, list] = {}
    for where, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((where, info))
    for name, items in by_file.items():
        with open(Path(path) / name, "rb") as shard:
            for where, info in items:
                problem = stored_plainly(shard, info.offset, info.length)
                if problem:
                    raise CheckpointError(
                        f"{Path(path) / name}: the item of {where.fqn} at byte {info.offset}: {problem}"
                    )


# A tensor's chunks are checked on a grid of their edges; a tensor cut into more cells than this is refused.
MAX_GRID_CELLS = 1 << 24


def _overlap(entry: TensorStorageMetadata) -> Optional[bool]:
    """Whether two chunks of a tensor share elements, or one reaches outside it (with the element counts adding
    up, chunks that do neither hold every element once); None when there are too many pieces to check. Exact:
    the chunks' edges along each dimension cut the tensor into a grid of cells, and each chunk marks its cells."""
    solid = [c for c in entry.chunks if math.prod(c.sizes)]
    if any(o < 0 or o + n > size for c in solid for o, n, size in zip(c.offsets, c.sizes, entry.size)):
        return True
    edges = [
        sorted({0, size} | {c.offsets[d] for c in solid} | {c.offsets[d] + c.sizes[d] for c in solid})
        for d, size in enumerate(entry.size)
    ]
    if math.prod(len(e) - 1 for e in edges) > MAX_GRID_CELLS:
        return None
    taken = torch.zeros([len(e) - 1 for e in edges], dtype=torch.bool)
    for c in solid:
        cells = tuple(slice(bisect_left(e, o), bisect_left(e, o + n)) for e, o, n in zip(edges, c.offsets, c.sizes))
        if taken[cells].any():
            return True
        taken[cells] = True
    return False


def verify_plain_dcp(path: Path) -> Metadata:
    """A DCP folder written by something else (e.g. `format_utils torch_to_dcp`): no COMPLETE marker, so no
    checksums; its index must read safely and every file it points into must be whole."""
    metadata = read_metadata(path)
    check_storage(path, metadata)
    return metadata


def check_checksums(path: Path) -> None:
    """Raise a CheckpointError naming the damaged files of `path`, if any. A collective when the process
    group is up (the ranks split the reading and agree on the verdict)."""
    if dist.is_available() and dist.is_initialized():
        errors = checksum_errors(path, dist.get_rank(), dist.get_world_size())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors)
        errors = sorted(e for rank_errors in gathered for e in rank_errors)
    else:
        errors = checksum_errors(path)
    if errors:
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise CheckpointError("; ".join(errors[:3]) + more)


def empty_like_saved(metadata: Metadata, key: str) -> torch.Tensor:
    """A tensor of the shape and dtype a checkpoint stores under `key`, for DCP to fill (zeros, not
    uninitialised memory: nothing of this process can pass for checkpoint data)."""
    entry = metadata.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"{key} is stored as bytes, where a tensor belongs")
    return torch.zeros(entry.size, dtype=entry.properties.dtype)


def saved_weights(metadata: Metadata, prefix: str = "model.") -> dict[str, TensorStorageMetadata]:
    """The model weights a checkpoint holds, by canonical name (their DCP metadata: shape, dtype). Our step
    folders keep them under `model.`; a plain DCP folder of a {name: tensor} file (prefix "") at the top."""
    return {
        k[len(prefix) :]: m
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and (prefix or isinstance(m, TensorStorageMetadata))
    }
