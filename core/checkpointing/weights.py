"""Model weights only: `checkpoint.init_from` (a step folder, .pt or .safetensors, or a Hugging Face folder through the
recipe's converter, into a sharded model),
plain weight files, and the full weights of a step folder in one process."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from core.checkpointing.layout import (
    DCP_ERRORS,
    SAVING_MARKER,
    CheckpointError,
    check_checksums,
    describe,
    empty_like_saved,
    is_complete,
    resolve_checkpoint,
    saved_weights,
    verify,
    verify_plain_dcp,
)
from core.checkpointing.pickle_guard import UnsafeCheckpoint, beyond_its_storage, beyond_their_storages, load_torch_file
from core.checkpointing.storage import SafeLoadPlanner, SafeReader
from core.config.errors import ConfigError
from core.layers.tensor_parallel import local_pieces

log = logging.getLogger("checkpoint")


def check_weights_fit(source: str, model: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Raise, listing them, if weights are missing from `saved`, unexpected in it, or of another shape.
    `saved` maps names to tensors or to DCP metadata."""
    missing, unexpected = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    shapes = [
        f"{k}: {_shape(saved[k]) or 'not a tensor'} vs model {tuple(model[k].shape)}"
        for k in sorted(set(saved) & set(model))
        if _shape(saved[k]) != tuple(model[k].shape)
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{source} does not fit the model:\n  missing in the checkpoint: {missing or 'none'}\n  unexpected in "
            f"the checkpoint: {unexpected or 'none'}\n  shape mismatches: {shapes or 'none'}"
        )


def _shape(value) -> Optional[tuple]:
    """The shape of a saved tensor (a tensor, or its DCP metadata); None for a value stored as bytes."""
    if isinstance(value, TensorStorageMetadata):
        return tuple(value.size)
    return tuple(value.shape) if torch.is_tensor(value) else None


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the slices of `full` that this rank holds into `target` (a plain tensor or a DTensor, evenly
    sharded by FSDP2 or unevenly by Megatron-FSDP, maybe tensor-parallel: all describe their slices as
    DCP chunks)."""
    if tuple(target.shape) != tuple(full.shape):
        raise CheckpointError(f"shape {tuple(full.shape)} does not fit the model's {tuple(target.shape)}")
    for offsets, local in local_pieces(target):
        local.detach().copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))])


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} from a .pt/.pth (also a {"model": {...}} nest) or .safetensors file."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 (safetensors' own error type is not a ValueError)
            raise CheckpointError(f"{path}: cannot read as safetensors ({type(e).__name__}: {e})") from None
    try:
        state = load_torch_file(path)
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"{path}: refusing to load it: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read as a torch file ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a {type(state).__name__}, expected a dict of tensors (a model state dict)")
    # Names are matched as text (prefixes, suffixes): anything else is not a state dict, refused here.
    for name, value in state.items():
        if not isinstance(name, str) or not torch.is_tensor(value):
            what = (
                f"a key that is not a name ({name!r:.60}, type {type(name).__name__})"
                if not isinstance(name, str)
                else f"{name!r:.60} holds a value of type {type(value).__name__}, not a tensor"
            )
            raise CheckpointError(f"{path}: {what}; expected a dict of names to tensors (a model state dict)")
        if beyond_its_storage(value):
            raise CheckpointError(f"{path}: refusing to load it: {name!r:.60} is {beyond_its_storage(value)}")
    aliased = beyond_their_storages(state.values())
    if aliased:
        raise CheckpointError(f"{path}: refusing to load it: {aliased}")
    return state


def _skipped(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def load_weights(
    parallel,
    source: str,
    skip_prefixes: list[str] = (),
    ignore_unexpected: bool = False,
    is_main: bool = True,
    verify_checksums: bool = True,
    hf_reader: Optional[Callable[[Path], dict[str, torch.Tensor]]] = None,
    fresh_if_missing: Callable[[str], bool] = lambda name: False,
) -> None:
    """Model weights only from a step folder, a .pt/.safetensors file or a Hugging Face folder (config.json and
    safetensors, converted in memory by `hf_reader`, the recipe's), into the (sharded) model `parallel` (a
    collective). Names under `skip_prefixes` keep their fresh initialisation, on both sides, and so do the names
    `fresh_if_missing` accepts where the source lacks them (a task head, LoRA adapters). Strict otherwise: every
    other weight must be in the source and fit; weights the source has but the model does not are an error, or
    with `ignore_unexpected` listed in the log and left out."""
    src = resolve_checkpoint(source)
    model = parallel.model_state_dict()
    wanted = {k: v for k, v in model.items() if not _skipped(k, skip_prefixes)}
    prefix = "model."
    if is_hf_folder(src):
        metadata, full = None, _read_hf_folder(src, source, hf_reader)
        saved = full
    elif src.is_dir() and not is_complete(src) and (src / ".metadata").is_file() and not (src / SAVING_MARKER).exists():
        # A DCP folder from elsewhere (format_utils torch_to_dcp): its weights under model. or at the top.
        metadata = verify_plain_dcp(src)
        prefix = "model." if saved_weights(metadata) else ""
        saved, full = saved_weights(metadata, prefix), None
        if is_main:
            log.info(
                "%s has no completion marker: reading it as a plain DCP folder (its index and file sizes "
                "checked; no checksums)",
                src,
            )
    elif src.is_dir():
        metadata = verify(src)
        saved = saved_weights(metadata)
        if verify_checksums:
            check_checksums(src)
        full = None
    elif src.is_file():
        metadata, full = None, load_weights_file(src)
        saved = full
    else:
        raise CheckpointError(f"checkpoint.init_from={source}: no such file or folder")
    saved = {k: v for k, v in saved.items() if not k.endswith("_extra_state") and not _skipped(k, skip_prefixes)}
    wanted = {k: v for k, v in wanted.items() if k in saved or not fresh_if_missing(k)}
    unused = sorted(set(saved) - set(model)) if ignore_unexpected else []
    check_weights_fit(
        f"checkpoint.init_from={source} (checkpoint.init_skip_prefixes={list(skip_prefixes)})",
        wanted,
        {k: v for k, v in saved.items() if k not in unused},
    )
    if full is None:
        try:
            target = {"model": wanted} if prefix else wanted
            dcp.load(target, storage_reader=SafeReader(str(src), metadata), planner=SafeLoadPlanner())
        except DCP_ERRORS as e:
            raise CheckpointError(f"{src}: loading failed ({describe(e)})") from None
    else:
        for k, v in wanted.items():
            copy_full_into(v, full[k].to(v.dtype))
    kept = sorted(set(model) - set(wanted))  # before loading: torch's set_model_state_dict may empty `wanted`
    loaded = len(wanted)
    parallel.load_model_state_dict(wanted)
    if is_main:
        log.info(
            "initialised %d weights from %s%s%s",
            loaded,
            source,
            f"; kept the fresh init of {kept}" if kept else "",
            f"; not used (checkpoint.init_ignore_unexpected): {unused}" if unused else "",
        )


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json beside its weights), not a step folder of ours."""
    return path.is_dir() and (path / "config.json").is_file() and not (path / ".metadata").exists()


def _read_hf_folder(
    folder: Path, source: str, reader: Optional[Callable[[Path], dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Our weights from a Hugging Face folder, converted in memory by the recipe's `reader`. Only safetensors are
    read: a pickled pytorch_model.bin could run code while it loads, so it is refused, naming it."""
    if reader is None:
        raise CheckpointError(
            f"checkpoint.init_from={source} is a Hugging Face folder (config.json), and this recipe has no Hugging "
            "Face conversion (recipes/<name>/hf.py: weights_from_hf_folder)"
        )
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise CheckpointError(
            f"checkpoint.init_from={source}: "
            + (
                f"{pickled[0]} is a pickle, which can run code while it loads; this tool reads Hugging Face weights "
                "as .safetensors only (save_pretrained(..., safe_serialization=True) writes them)"
                if pickled
                else "a Hugging Face folder without a .safetensors weights file"
            )
        )
    try:
        return reader(folder)
    except ConfigError:  # a setting of the run that does not fit the folder: its message names both
        raise
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CheckpointError(f"checkpoint.init_from={source}: {e}") from None


def read_model_weights(step_dir: Path, verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint (a step folder, or a root's newest), in one process, by
    canonical name."""
    step_dir = resolve_checkpoint(step_dir)
    metadata = verify(step_dir)
    if verify_checksums:
        check_checksums(step_dir)
    not_tensors = [
        k
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("model.") and not isinstance(m, TensorStorageMetadata)
    ]
    if not_tensors:
        raise CheckpointError(f"{step_dir}: {not_tensors[0]} is stored as bytes, not as a tensor: not model weights")
    weights = {k[6:]: empty_like_saved(metadata, k) for k in metadata.state_dict_metadata if k.startswith("model.")}
    state: dict[str, Any] = {"model": weights}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=SafeReader(str(step_dir), metadata), planner=SafeLoadPlanner(), no_dist=True)
        except DCP_ERRORS as e:
            raise CheckpointError(f"{step_dir}: loading failed ({describe(e)})") from None
    return weights
