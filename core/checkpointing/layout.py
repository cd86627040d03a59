"""The on-disk layout of checkpoints, and how a folder is judged complete and whole.

`<checkpoint.path>/step_<N>/` holds (the same for every backend, world size and layer implementation):
  model.<name>          weights by their names in the user's model (no wrapper prefix such as `module.`)
  optim.state.<name>.*  optimizer state keyed by those parameter names; optim.param_groups
  scheduler             the LR scheduler's state
  train_state.*         step, consumed_samples, epoch, skipped_steps, dataset_len, world_size
  rng.rank_<r>.*        python/numpy/torch/CUDA RNG states of rank r
  fp8.<module>.*        TransformerEngine's delayed-scaling FP8 state (scales and amax histories), which
                        Megatron-FSDP's state dict drops with the rest of TE's `_extra_state`
  config.yaml           the resolved config of the run (rank 0)
  COMPLETE              written last, by rank 0, after every rank finished; lists the file sizes
Everything DCP stores is a tensor or a plain value, never a pickled object, so
`python -m torch.distributed.checkpoint.format_utils dcp_to_torch` output loads with torch.load's default
weights_only=True. A folder without COMPLETE (or whose files do not match it) is never resumed from.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"

# DCP gathers every rank's failure into one CheckpointException, which derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model; names the path."""


def describe(error: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException) and getattr(error, "failures", None):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(error.failures.items()))
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


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file() and (Path(path) / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    return [p for p in step_dirs(root) if is_complete(p)]


def write_marker(folder: Path, marker: dict[str, Any]) -> None:
    """Write COMPLETE atomically (whole or absent, never half), listing the sizes of the folder's files."""
    folder = Path(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != COMPLETE_MARKER}
    tmp = folder / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps({**marker, "files": files}, indent=1))
    os.replace(tmp, folder / COMPLETE_MARKER)


def read_marker(path: Path) -> dict:
    try:
        return json.loads((Path(path) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{Path(path) / COMPLETE_MARKER}: unreadable completion marker ({e})") from None


def read_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001  (any unpickling / IO error means the same to the user)
        raise CheckpointError(f"{Path(path) / '.metadata'}: unreadable DCP metadata ({type(e).__name__}: {e})") from None


def verify(path: Path) -> Metadata:
    """Check that `path` is a complete checkpoint whose files are all there, whole; return its metadata.

    Catches interrupted saves (no marker), missing and truncated files, naming the file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE_MARKER} marker: its save was interrupted)")
    marker = read_marker(path)
    metadata = read_metadata(path)
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {COMPLETE_MARKER})")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, but {size} were written (truncated or changed)")
    for info in (metadata.storage_data or {}).values():
        file = path / info.relative_path
        if not file.is_file() or file.stat().st_size < info.offset + info.length:
            raise CheckpointError(f"{file}: missing or truncated (DCP metadata expects >= {info.offset + info.length} bytes)")
    return metadata


def empty_like_saved(metadata: Metadata, key: str) -> torch.Tensor:
    """An uninitialised tensor of the shape and dtype a checkpoint stores under `key`, for DCP to fill."""
    m = metadata.state_dict_metadata[key]
    return torch.empty(m.size, dtype=m.properties.dtype)


def saved_weights(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model weights a checkpoint holds, by canonical name (their DCP metadata: shape, dtype)."""
    return {k[6:]: m for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
