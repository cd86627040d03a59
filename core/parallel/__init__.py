"""Data-parallel backends (`distributed.backend`): mfsdp, fsdp2, ddp, or auto.

auto = Megatron-FSDP on CUDA, torch FSDP2 on CPU (gloo).
"""

from __future__ import annotations

import importlib
from typing import Union

import torch
from torch import nn

from core.config import ConfigError, DistributedConfig
from core.distributed import DistEnv
from core.parallel.base import Parallel, full_tensor
from core.precision import DTYPES

BACKENDS = ("mfsdp", "fsdp2", "ddp")

__all__ = ["BACKENDS", "Parallel", "full_tensor", "resolve_backend", "shard"]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "mfsdp" if device.type == "cuda" else "fsdp2"
    if backend not in BACKENDS:
        raise ConfigError(f"distributed.backend={backend!r}: expected auto, {', '.join(BACKENDS)}")
    if backend == "mfsdp" and device.type != "cuda":
        raise ConfigError("distributed.backend=mfsdp needs CUDA GPUs (Megatron-FSDP 0.6.1 is CUDA-only); "
                          "use fsdp2 or ddp on CPU")
    return backend


def _unit_classes(names: list[str] | None, default: list[type]) -> list[type]:
    if names is None:
        return default
    classes = []
    for path in names:
        module, _, cls = path.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(f"fsdp_unit_modules: cannot import {path!r} (give module.Class)") from None
    return classes


def shard(model: nn.Module, backend: str, env: DistEnv, cfg: DistributedConfig, default_units: list[type],
          param_dtype: str) -> Parallel:
    """Wrap `model` (full, identical on every rank, already on env.device) for data parallelism."""
    if env.tp > 1:
        raise ConfigError(f"distributed.tp={env.tp}: this recipe does not support tensor parallelism")
    if backend == "fsdp2":
        from core.parallel.fsdp2 import FSDP2

        return FSDP2(model, env, cfg.fsdp2, _unit_classes(cfg.fsdp2.fsdp_unit_modules, default_units), param_dtype)
    # DDP and Megatron-FSDP compute with the model's own parameter dtype.
    model.to(DTYPES[param_dtype])
    if backend == "ddp":
        from core.parallel.ddp import DDP

        return DDP(model, env, cfg.ddp)
    from core.parallel.mfsdp import MegatronFSDP

    units: list[Union[type, str]] = _unit_classes(cfg.mfsdp.fsdp_unit_modules, default_units)
    return MegatronFSDP(model, env, cfg.mfsdp, units)
