"""Conversion between step folders and plain weight files (one process, no GPU needed)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from core.checkpointing.layout import STEP_DIR, CheckpointError, start_marker, write_marker
from core.checkpointing.output_files import save_safetensors, save_torch
from core.checkpointing.storage import ChecksummingWriter
from core.checkpointing.weights import load_weights_file, read_model_weights
from core.training.state import TrainState


def to_torch(step_dir: str, out: str, verify_checksums: bool = True) -> None:
    """A step folder's full model weights -> one torch.save file ({name: tensor})."""
    weights = read_model_weights(Path(step_dir), verify_checksums)
    save_torch(weights, Path(out))
    print(f"wrote {len(weights)} tensors to {out}")


def to_safetensors(step_dir: str, out: str, verify_checksums: bool = True) -> None:
    """A step folder's full model weights -> one .safetensors file."""
    weights = read_model_weights(Path(step_dir), verify_checksums)
    save_safetensors({k: v.contiguous() for k, v in weights.items()}, Path(out))
    print(f"wrote {len(weights)} tensors to {out}")


def from_torch(source: str, step_dir: str) -> None:
    """A step folder holding only model weights (resuming from it starts a fresh optimizer at step 0)."""
    target = Path(step_dir)
    if target.exists():
        raise SystemExit(f"{target} exists; choose a new folder")
    write_weights_step(load_weights_file(Path(source)), target, str(source))


def write_weights_step(weights: dict, target: Path, source: str) -> None:
    """A complete step folder (checksummed, marked) of model weights alone, at step 0."""
    named = STEP_DIR.match(target.name)
    if named and named.group(1) != "0":  # a marker's step must be its folder's (layout.read_marker)
        raise CheckpointError(
            f"{target}: a folder of weights alone holds step 0; name it step_0, or anything but step_<N>"
        )
    weights = {k: v for k, v in weights.items() if not k.endswith("_extra_state")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        start_marker(target)
        dcp.save(
            {"model": weights, "train_state": TrainState().state_dict()},
            storage_writer=ChecksummingWriter(str(target)),
            no_dist=True,
        )
    write_marker(target, {"step": 0, "metrics": {}, "converted_from": source})
    print(f"wrote {len(weights)} tensors to {target}")
