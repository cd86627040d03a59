"""Torch DCP checkpoints: `<checkpoint.path>/step_<N>/`, auto-resume, retention, conversion.

Layout of a step folder (the same for every backend, world size and layer implementation):
  model.<name>          weights by their names in the user's model (no wrapper prefix such as `module.`)
  optim.state.<name>.*  optimizer state keyed by those parameter names; optim.param_groups
  scheduler             the LR scheduler's state
  train_state.*         step, consumed_samples, epoch, skipped_steps, dataset_len, world_size
  rng.rank_<r>.*        python/numpy/torch/CUDA RNG states of rank r
  fp8.<module>.*        TransformerEngine's delayed-scaling FP8 state (scales and amax histories), which
                        Megatron-FSDP's state dict drops with the rest of TE's `_extra_state`
Everything is a tensor or a plain value, never a pickled object: loading a checkpoint runs no code
from it, and `python -m torch.distributed.checkpoint.format_utils dcp_to_torch` output loads with
torch.load's default weights_only=True.
  config.yaml           the resolved config of the run (rank 0)
  COMPLETE              written last, by rank 0, after every rank finished; lists the file sizes

A folder without COMPLETE (or whose files do not match it) is never resumed from; it is deleted after
the next successful save.

Command line (one process, no GPU needed):
  python checkpoint.py to-torch <step_dir> <out.pt>
  python checkpoint.py to-safetensors <step_dir> <out.safetensors>
  python checkpoint.py from-torch <file.pt|file.safetensors> <step_dir>
"""

from __future__ import annotations

import argparse
import copy as copy_module
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from core.config import CheckpointConfig, ConfigError
from core.tensor_parallel import attach_pieces, local_pieces

log = logging.getLogger("checkpoint")

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_KEYS = ("step", "consumed_samples", "epoch", "skipped_steps", "dataset_len", "world_size")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model; names the path."""


# DCP gathers every rank's failure into one CheckpointException, which derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)


def describe(error: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException) and getattr(error, "failures", None):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


# ----------------------------------------------------------------------------- finding checkpoints


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


def complete_checkpoints(root: Path) -> list[Path]:
    return [p for p in step_dirs(root) if is_complete(p)]


def top_level_keys(metadata: Metadata) -> set[str]:
    return {k.split(".", 1)[0] for k in metadata.state_dict_metadata}


def saved_weights(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model weights a checkpoint holds, by canonical name (their DCP metadata: shape, dtype)."""
    return {k[6:]: m for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}


def check_weights_fit(source: str, model: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    """Raise, listing them, if weights are missing from `saved`, unexpected in it, or of another shape.
    `saved` maps names to tensors or to DCP metadata."""
    missing, unexpected = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    shapes = [f"{k}: {tuple(_shape(saved[k]))} vs model {tuple(model[k].shape)}" for k in sorted(set(saved) & set(model))
              if tuple(_shape(saved[k])) != tuple(model[k].shape)]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{source} does not fit the model:\n  missing in the checkpoint: {missing or 'none'}\n  unexpected in "
            f"the checkpoint: {unexpected or 'none'}\n  shape mismatches: {shapes or 'none'}")


# ----------------------------------------------------------------------------- per-rank state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys.astype(np.int64), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    python = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    random.setstate((python[0], tuple(python[1:]), None if gauss != gauss else gauss))
    numpy = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(numpy[:-2], dtype=np.uint32), numpy[-2], numpy[-1],
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


FP8_TENSORS = {"scale_fwd": ("scaling_fwd", "scale"), "amax_history_fwd": ("scaling_fwd", "amax_history"),
               "scale_bwd": ("scaling_bwd", "scale"), "amax_history_bwd": ("scaling_bwd", "amax_history")}


def fp8_states(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """TransformerEngine modules' delayed-scaling FP8 state (what their `_extra_state` holds), as tensors."""
    out = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict) or getattr(meta.get("scaling_bwd"), "amax_history", None) is None:
            continue
        out[name] = {key: getattr(meta[group], attr).detach().cpu().clone() for key, (group, attr) in FP8_TENSORS.items()}
        # TE also keeps the module's plain settings (num_gemms, ...); JSON keeps them data, not code.
        plain = {k: (["__tuple__", list(v)] if isinstance(v, tuple) else v) for k, v in meta.items()
                 if k != "buffer_index_and_autocast_key" and _is_plain(v)}
        out[name]["settings"] = torch.frombuffer(bytearray(json.dumps(plain).encode()), dtype=torch.uint8)
    return out


def _is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, (bool, int, float, str)) for v in value)
    return isinstance(value, (bool, int, float, str))


def _fp8_settings(blob: torch.Tensor) -> dict:
    plain = json.loads(blob.numpy().tobytes().decode())
    return {k: (tuple(v[1]) if isinstance(v, list) and v[:1] == ["__tuple__"] else v) for k, v in plain.items()}


def set_fp8_states(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]], recipe: Any) -> None:
    """Restore FP8 scales and amax histories through TE's own `set_extra_state`.

    TE takes that state only as a pickle and, rightly, refuses pickles from files unless told to trust
    them. Ours is built here from plain tensors and the run's own recipe, never read from the file,
    so it is safe to let TE load it."""
    modules = dict(model.named_modules())
    previous = os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"
    try:
        for name, tensors in saved.items():
            tensors = dict(tensors)
            settings = _fp8_settings(tensors.pop("settings")) if "settings" in tensors else {}
            payload = pickle.dumps({"recipe": recipe, **tensors, "extra_fp8_variables": settings})
            modules[name].set_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        torch.cuda.synchronize()  # TE copies the tensors asynchronously
    finally:
        if previous is None:
            os.environ.pop("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
        else:
            os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = previous


# ----------------------------------------------------------------------------- full tensors into shards


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

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read as a torch file ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors (a model state dict)")
    return state


def _skipped(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def load_weights(par, source: str, skip_prefixes: list[str] = (), ignore_unexpected: bool = False,
                 is_main: bool = True) -> None:
    """Model weights only from a step folder or a .pt/.safetensors file, into the (sharded) model `par`
    (a collective). Names under `skip_prefixes` keep their fresh initialisation, on both sides. Strict
    otherwise: every other weight must be in the source and fit; weights the source has but the model
    does not are an error, or with `ignore_unexpected` listed in the log and left out."""
    src = Path(source)
    model = par.model_state_dict()
    wanted = {k: v for k, v in model.items() if not _skipped(k, skip_prefixes)}
    if src.is_dir():
        saved = saved_weights(verify(src))
        full = None
    elif src.is_file():
        full = load_weights_file(src)
        saved = full
    else:
        raise CheckpointError(f"checkpoint.init_from={source}: no such file or folder")
    saved = {k: v for k, v in saved.items() if not k.endswith("_extra_state") and not _skipped(k, skip_prefixes)}
    unused = sorted(set(saved) - set(model)) if ignore_unexpected else []
    check_weights_fit(f"checkpoint.init_from={source} (checkpoint.init_skip_prefixes={list(skip_prefixes)})", wanted,
                      {k: v for k, v in saved.items() if k not in unused})
    if full is None:
        try:
            dcp.load({"model": wanted}, checkpoint_id=str(src))
        except DCP_ERRORS as e:
            raise CheckpointError(f"{src}: loading failed ({describe(e)})") from None
    else:
        for k, v in wanted.items():
            copy_full_into(v, full[k].to(v.dtype))
    par.load_model_state_dict(wanted)
    if is_main:
        kept = sorted(set(model) - set(wanted))
        log.info("initialised %d weights from %s%s%s", len(wanted), source,
                 f"; kept the fresh init of {kept}" if kept else "",
                 f"; not used (checkpoint.init_ignore_unexpected): {unused}" if unused else "")


# ----------------------------------------------------------------------------- retention


def checkpoints_to_keep(entries: list[tuple[int, Optional[float]]], keep_last_n: int, keep_every_n_steps: int,
                        keep_best_k: int, mode: str, protected: set[int]) -> set[int]:
    """Steps to keep among complete checkpoints `entries` = [(step, monitored value or None)]."""
    steps = sorted(step for step, _ in entries)
    keep = set(protected) | (set(steps) if keep_last_n < 0 else set(steps[-keep_last_n:]))
    if keep_every_n_steps > 0:
        keep |= {s for s in steps if s % keep_every_n_steps == 0}
    scored = [(value if mode == "min" else -value, step) for step, value in entries if value is not None]
    keep |= {step for _, step in sorted(scored)[:keep_best_k]}
    if steps:
        keep.add(steps[-1])  # the newest: what a restart resumes from
    return keep


# ----------------------------------------------------------------------------- the checkpointer


@dataclass
class Restored:
    path: Path
    train_state: dict
    rng: Optional[dict]  # this rank's RNG states, None if the checkpoint has none for it


class Checkpointer:
    """Everything the training loop does with checkpoints. All methods are collectives unless noted."""

    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, device: torch.device,
                 config: Optional[DictConfig] = None, fp8_recipe: Any = None):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.fp8_recipe = fp8_recipe  # TE's recipe object when the run uses FP8 (restores FP8 state)
        self.config = config  # the run's resolved config, saved beside each checkpoint
        self.auto = False  # resume=auto|true: a corrupt newest checkpoint falls back to the one before
        self.is_main = rank == 0
        self.path = Path(cfg.path)
        self.pending: Optional[tuple[Future, Path, int, dict, float]] = None
        self.protected: set[int] = set()
        self._async_group = None
        self._stager = HostStager()
        self._check_options()
        self.candidates = self._resume_candidates()

    def _check_options(self) -> None:
        c = self.cfg
        if c.keep_last_n == 0 or c.keep_last_n < -1:
            raise ConfigError(f"checkpoint.keep_last_n={c.keep_last_n}: expected -1 (keep all) or >= 1 (the newest "
                              "checkpoint is always needed to resume)")
        if c.monitor_mode not in ("min", "max"):
            raise ConfigError(f"checkpoint.monitor_mode={c.monitor_mode!r}: expected min or max")
        if c.keep_best_k > 0 and not c.monitor:
            raise ConfigError("checkpoint.keep_best_k needs checkpoint.monitor (e.g. val/loss)")
        if c.save_every_n_steps < 0:
            raise ConfigError(f"checkpoint.save_every_n_steps={c.save_every_n_steps}: expected >= 0")

    def _resume_candidates(self) -> list[Path]:
        """Checkpoints to try in order (newest first), decided before any work."""
        resume = self.cfg.resume
        existing = step_dirs(self.path)
        if resume is False or (isinstance(resume, str) and resume.lower() in ("false", "no", "none", "")):
            if existing and not self.cfg.overwrite:
                raise ConfigError(
                    f"checkpoint.path={self.path} already holds checkpoints ({existing[-1].name}, ...) and "
                    "checkpoint.resume=false: set checkpoint.overwrite=true to delete them, or use another path")
            if existing and self.is_main:
                log.warning("checkpoint.overwrite=true: deleting %d step folders under %s", len(existing), self.path)
                for p in existing:
                    shutil.rmtree(p)
            return []
        if resume is True or (isinstance(resume, str) and resume.lower() in ("auto", "true")):
            self.auto = True
            complete = complete_checkpoints(self.path)
            partial = [p.name for p in existing if not is_complete(p)]
            if partial and self.is_main:
                log.warning("ignoring incomplete checkpoints (interrupted saves) under %s: %s", self.path,
                            ", ".join(partial))
            if not complete and (resume is True or resume.lower() == "true"):
                raise ConfigError(f"checkpoint.resume=true but {self.path} holds no complete checkpoint")
            return complete[::-1]
        if isinstance(resume, str):
            path = Path(resume)
            verify(path)  # an explicit choice never falls back: missing or incomplete is an error
            return [path]
        raise ConfigError(f"checkpoint.resume={resume!r}: expected auto, true, false or a step folder")

    # ---- loading

    def restore(self, par, optimizer, scheduler) -> Optional[Restored]:
        """Load the newest usable checkpoint into model, optimizer and scheduler; None to start fresh.

        Automatic resume skips a corrupt checkpoint with a warning and uses the one before it."""
        for i, path in enumerate(self.candidates):
            try:
                restored = self._load(path, par, optimizer, scheduler)
            except CheckpointError as e:
                if not self.auto or i == len(self.candidates) - 1:
                    raise
                log.warning("cannot resume from %s: %s; trying the previous checkpoint", path, e)
                continue
            self.protected.add(step_of(path) or -1)
            return restored
        return None

    def _load(self, path: Path, par, optimizer, scheduler) -> Restored:
        start = time.perf_counter()
        metadata = verify(path)
        present = top_level_keys(metadata)
        saved = set(metadata.state_dict_metadata)
        model = par.model_state_dict()
        check_weights_fit(str(path), model, saved_weights(metadata))
        state: dict[str, Any] = {"model": model}
        if "optim" in present:
            state["optim"] = par.optimizer_state_dict(optimizer)
        if "scheduler" in present:
            state["scheduler"] = scheduler.state_dict()
        train_keys = [k for k in TRAIN_STATE_KEYS if f"train_state.{k}" in saved]
        state["train_state"] = {k: 0 for k in train_keys}
        rng_prefix = f"rng.rank_{self.rank}."
        rng = {k[len(rng_prefix):]: _empty_like_saved(metadata, k) for k in saved if k.startswith(rng_prefix)}
        if rng:
            state["rng"] = {f"rank_{self.rank}": rng}
        fp8 = {}
        for key in saved:
            if key.startswith("fp8."):
                module, tensor = key[4:].rsplit(".", 1)
                fp8.setdefault(module, {})[tensor] = _empty_like_saved(metadata, key)
        if fp8 and self.fp8_recipe is None:
            log.warning("%s holds FP8 scaling state, but this run does not use TE FP8: not loaded", path)
            fp8 = {}
        if fp8:
            state["fp8"] = fp8
        try:
            dcp.load(state, checkpoint_id=str(path))
        except DCP_ERRORS as e:
            raise CheckpointError(f"{path}: loading failed ({describe(e)})") from None
        par.load_model_state_dict(state["model"])
        if "optim" in state:
            par.load_optimizer_state_dict(optimizer, state["optim"])
        elif self.is_main:
            log.warning("%s has no optimizer state: the optimizer starts fresh", path)
        if "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        if fp8:
            set_fp8_states(par.inner, fp8, self.fp8_recipe)
        train_state = {k: 0 for k in TRAIN_STATE_KEYS} | state["train_state"]
        rng = state["rng"][f"rank_{self.rank}"] if "rng" in state else None
        if self.is_main:
            log.info("resumed from %s (step %d, %d samples consumed) in %.1f s", path, train_state["step"],
                     train_state["consumed_samples"], time.perf_counter() - start)
            self._report_config_changes(path)
        return Restored(path, train_state, rng)

    def _report_config_changes(self, path: Path) -> None:
        saved_file = path / "config.yaml"
        if not saved_file.is_file() or self.config is None:
            return
        saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_file)))
        now = _flatten(OmegaConf.to_container(self.config, resolve=True))
        changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if changed:
            log.warning("config differs from the checkpoint's: %s", ", ".join(
                f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:20]))

    # ---- saving

    def should_save(self, step: int, last_step: int) -> bool:
        periodic = self.cfg.save_every_n_steps > 0 and step % self.cfg.save_every_n_steps == 0
        return periodic or (self.cfg.save_final and step == last_step)

    def save(self, step: int, par, optimizer, scheduler, train_state: dict, metrics: dict,
             force_sync: bool = False) -> float:
        """Save step_<step>; return the seconds the training loop was held up."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        target = self.path / f"step_{step}"
        if self.is_main:
            if target.exists():  # an interrupted save of this step (resumed from an earlier one)
                log.warning("removing %s %s before saving it again", "complete" if is_complete(target) else
                            "incomplete", target)
                shutil.rmtree(target)
            self.path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = {
            "model": par.model_state_dict(),
            "optim": par.optimizer_state_dict(optimizer),
            "scheduler": scheduler.state_dict(),
            "train_state": {k: int(train_state[k]) for k in TRAIN_STATE_KEYS},
            "rng": {f"rank_{self.rank}": rng_state(self.device)},
        }
        fp8 = fp8_states(par.inner)
        if fp8:
            state["fp8"] = fp8
        if self.cfg.async_save and not force_sync:
            if self._async_group is None:  # its own group: the writer thread's collectives stay off the loop's
                self._async_group = dist.new_group(backend="gloo")
            # We copy to host memory ourselves (see HostStager) and hand DCP the copy as already staged.
            future = dcp.async_save(self._stager.stage(state), checkpoint_id=str(target),
                                    process_group=self._async_group, async_stager=_AlreadyStaged())
            self.pending = (future, target, step, metrics, start)
        else:
            try:
                dcp.save(state, checkpoint_id=str(target))
            except DCP_ERRORS as e:  # disk full, permissions: fail loudly, keep the older checkpoints
                raise CheckpointError(f"saving {target} failed ({describe(e)})") from None
            dist.barrier()  # every rank's files are on disk before the marker says so
            self._finish(target, step, metrics, start)
        return time.perf_counter() - start

    def poll(self) -> None:
        """Complete an async save if its writes are done (not a collective; cheap)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, and complete it."""
        if self.pending is None:
            return
        future, target, step, metrics, start = self.pending
        self.pending = None
        try:
            future.result()
        except DCP_ERRORS as e:
            raise CheckpointError(f"saving {target} failed ({describe(e)})") from None
        # On rank 0 the future ends after DCP wrote .metadata, which it does only once every rank has
        # reported its writes done: rank 0 may write the marker now.
        self._finish(target, step, metrics, start)

    def _finish(self, target: Path, step: int, metrics: dict, start: float) -> None:
        if not self.is_main:
            return
        if self.config is not None:
            OmegaConf.save(self.config, target / "config.yaml", resolve=True)
        files = {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.is_file()}
        marker = {"step": step, "files": files, "metrics": metrics, "saved_at": time.time()}
        tmp = target / (COMPLETE_MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=1))
        os.replace(tmp, target / COMPLETE_MARKER)  # atomic: the marker is whole or absent
        size = sum(files.values())
        seconds = time.perf_counter() - start
        log.info("saved checkpoint %s (%.1f MB in %.2f s%s)", target, size / 2**20, seconds,
                 ", async" if self.cfg.async_save else "")
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Rank 0, after a checkpoint completed: drop interrupted saves and what the keep_* rules release."""
        in_flight = self.pending[1] if self.pending is not None else None
        entries = []
        for p in step_dirs(self.path):
            if p == in_flight:
                continue
            if not is_complete(p):
                log.info("deleting incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)
                continue
            value = read_marker(p).get("metrics", {}).get(self.cfg.monitor) if self.cfg.monitor else None
            entries.append((step_of(p), value))
        keep = checkpoints_to_keep(entries, self.cfg.keep_last_n, self.cfg.keep_every_n_steps,
                                   self.cfg.keep_best_k, self.cfg.monitor_mode, self.protected)
        for step, _ in entries:
            if step not in keep:
                log.info("deleting checkpoint step_%d (retention)", step)
                shutil.rmtree(self.path / f"step_{step}", ignore_errors=True)

    def check_monitor(self, metrics: dict) -> None:
        if self.cfg.monitor and metrics and self.cfg.monitor not in metrics:
            raise ConfigError(f"checkpoint.monitor={self.cfg.monitor!r} is not a validation metric; "
                              f"there are: {', '.join(sorted(metrics))}")


class HostStager:
    """Copies a state dict to host memory for a background save, keeping each DTensor's sharding.

    DCP's own staging copies whole tensor storages, which fails on Megatron-FSDP's state (views into
    flat buffers, some freed). We copy each local shard instead and keep the sharding description,
    including the hooks by which Megatron-FSDP tells DCP the offsets of its uneven shards.
    From a GPU the copies go into pinned buffers kept from one save to the next (the previous save has
    finished writing them: Checkpointer.save waits for it first) and run without a sync per tensor, so
    the loop waits for one transfer at full PCIe speed rather than for many pageable copies; the cost is
    one checkpoint shard of pinned host memory per rank."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        staged = self._copy(state, ())
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the device-to-host copies above were only queued
        return staged

    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, DTensor):
            local = value._local_tensor
            copy = self._host_copy(local, path)
            if hasattr(local, "_full_layout_pieces"):  # tensor-parallel GLU rows (core.tensor_parallel)
                attach_pieces(copy, local._full_layout_pieces, value.shape)
            else:
                for hook in ("__create_chunk_list__", "__create_write_items__"):
                    if hook in local.__dict__:
                        setattr(copy, hook, local.__dict__[hook])
            return DTensor(copy, value._spec, requires_grad=False)
        if torch.is_tensor(value):
            return self._host_copy(value, path)
        return copy_module.deepcopy(value)  # e.g. the scheduler's lists, which it may change in place

    def _host_copy(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.to("cpu", copy=True)
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor, non_blocking=True)


class _AlreadyStaged:
    """DCP AsyncStager protocol for a state dict that HostStager already copied."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _empty_like_saved(metadata: Metadata, key: str) -> torch.Tensor:
    m = metadata.state_dict_metadata[key]
    return torch.empty(m.size, dtype=m.properties.dtype)


def _shape(value) -> torch.Size:
    return value.size if isinstance(value, TensorStorageMetadata) else value.shape


# ----------------------------------------------------------------------------- conversion CLI


def read_model_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint, in one process, by canonical name."""
    metadata = verify(step_dir)
    weights = {k[6:]: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in metadata.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    state: dict[str, Any] = {"model": weights}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return weights


def to_torch(step_dir: str, out: str) -> None:
    weights = read_model_weights(Path(step_dir))
    torch.save(weights, out)
    print(f"wrote {len(weights)} tensors to {out}")


def to_safetensors(step_dir: str, out: str) -> None:
    from safetensors.torch import save_file

    weights = read_model_weights(Path(step_dir))
    save_file({k: v.contiguous() for k, v in weights.items()}, out)
    print(f"wrote {len(weights)} tensors to {out}")


def from_torch(source: str, step_dir: str) -> None:
    """A step folder holding only model weights (resuming from it starts a fresh optimizer at step 0)."""
    target = Path(step_dir)
    if target.exists():
        raise SystemExit(f"{target} exists; choose a new folder")
    weights = load_weights_file(Path(source))
    weights = {k: v for k, v in weights.items() if not k.endswith("_extra_state")}
    train_state = {k: 0 for k in TRAIN_STATE_KEYS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": weights, "train_state": train_state}, checkpoint_id=str(target), no_dist=True)
    files = {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.is_file()}
    (target / COMPLETE_MARKER).write_text(json.dumps({"step": 0, "files": files, "metrics": {},
                                                       "converted_from": str(source)}, indent=1))
    print(f"wrote {len(weights)} tensors to {target}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Convert checkpoints of this repository's training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-torch", help="step folder -> one torch.save file of the full model weights")
    p.add_argument("step_dir")
    p.add_argument("out")
    p = sub.add_parser("to-safetensors", help="step folder -> one .safetensors file of the full model weights")
    p.add_argument("step_dir")
    p.add_argument("out")
    p = sub.add_parser("from-torch", help=".pt/.safetensors model weights -> a step folder")
    p.add_argument("source")
    p.add_argument("step_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-torch":
            to_torch(args.step_dir, args.out)
        elif args.command == "to-safetensors":
            to_safetensors(args.step_dir, args.out)
        else:
            from_torch(args.source, args.step_dir)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
