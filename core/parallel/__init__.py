"""Data-parallel backends (`distributed.backend`): mfsdp, fsdp2, ddp, or auto.

auto = Megatron-FSDP on CUDA, torch FSDP2 on CPU (gloo). Tensor parallelism (distributed.tp > 1) combines
with mfsdp (TE or plain-torch layers) and with fsdp2 (plain-torch layers), not with ddp.
"""

from __future__ import annotations

import importlib
from typing import Union

import torch
from torch import nn

from core.config import ConfigError, DistributedConfig
from core.distributed import DistEnv
from core.parallel.base import Parallel
from core.precision import DTYPES
from core.tensor_parallel import splits, unmark_whole_parameters

BACKENDS = ("mfsdp", "fsdp2", "ddp")

__all__ = ["BACKENDS", "Parallel", "resolve_backend", "shard"]


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
    """Wrap `model` (identical on every rank, or on every rank of a tensor-parallel position; already on
    env.device) for data parallelism."""
    if backend == "ddp" and param_dtype != "fp32":
        raise ConfigError(f"distributed.backend=ddp with precision.param_dtype={param_dtype}: DDP would train the "
                          "weights themselves in that dtype, with no fp32 master copy; use precision.param_dtype=fp32 "
                          "with ddp, or mfsdp / fsdp2, which keep fp32 master weights")
    split = splits(model) if env.tp > 1 else {}
    if env.tp > 1:
        if not split:
            raise ConfigError(f"distributed.tp={env.tp}: this recipe's model has no tensor-parallel layers")
        if backend == "ddp":
            raise ConfigError("distributed.tp > 1 needs distributed.backend=mfsdp or fsdp2 (ddp keeps whole replicas)")
        unmark_whole_parameters(model)
    if backend == "fsdp2":
        from core.parallel.fsdp2 import FSDP2

        par: Parallel = FSDP2(model, env, cfg.fsdp2, _unit_classes(cfg.fsdp2.fsdp_unit_modules, default_units),
                              param_dtype)
    else:
        # DDP and Megatron-FSDP compute with the model's own parameter dtype.
        model.to(DTYPES[param_dtype])
        if backend == "ddp":
            from core.parallel.ddp import DDP

            par = DDP(model, env, cfg.ddp)
        else:
            from core.parallel.mfsdp import MegatronFSDP

            units: list[Union[type, str]] = _unit_classes(cfg.mfsdp.fsdp_unit_modules, default_units)
            par = MegatronFSDP(model, env, cfg.mfsdp, units)
    # GLU weights are checkpointed in their TP=1 layout (core.tensor_parallel).
    par.tp_size, par.glu = env.tp, {name for name, s in split.items() if s.glu}
    return par
