"""`parallelize`: from the model a recipe built to the `Parallel` wrapper the loop trains, in one order:

  1. tensor parallelism   the layers were built tensor-parallel (core/layers/tensor_parallel.py); here the
                          split parameters are found and whole ones marked as replicated
  2. activation checkpointing   (training.activation_checkpointing) blocks recompute in the backward pass
  3. compilation          (training.compile) torch.compile each block's forward
  4. sharding             the resolved data-parallel backend: mfsdp, fsdp2 or ddp (core/runtime.py)

Tensor parallelism combines with mfsdp (TE or plain-torch layers) and fsdp2 (plain-torch layers), not with
ddp (core/runtime.py refuses that).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from core.config.errors import ConfigError
from core.config.schema import DistributedConfig, ParallelBackend
from core.distributed.env import DistEnv
from core.layers.namespace import Layers
from core.layers.tensor_parallel import Split, splits, unmark_whole_parameters
from core.parallel import activation_checkpointing as activation_checkpointing_lib
from core.parallel import compilation
from core.parallel.base import Parallel
from core.runtime import Runtime


def parallelize(
    model: nn.Module,
    runtime: Runtime,
    env: DistEnv,
    cfg: DistributedConfig,
    layers: Layers,
    block_classes: list[type],
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> Parallel:
    """Wrap `model` (identical on every rank, or on every rank of a tensor-parallel position; already on
    env.device) as `runtime.parallel` says; `block_classes` are the recipe's transformer blocks (the
    units of recomputation, compilation and sharding)."""
    blocks = [
        n for n, m in model.named_modules() if isinstance(m, tuple(c for c in block_classes if isinstance(c, type)))
    ]
    split = _tensor_parallel(model, env)
    if activation_checkpointing:  # trade compute for memory
        activation_checkpointing_lib.apply(model, block_classes, layers.checkpoint)
    if compile:  # after recomputation, so that the recomputed forward is compiled too
        compilation.apply(model, block_classes)
    parallel = _shard(model, runtime, env, cfg, block_classes)
    # GLU weights are checkpointed in their TP=1 layout (core/layers/tensor_parallel.py).
    parallel.tp_size, parallel.glu = env.tp, {name for name, s in split.items() if s.glu}
    parallel.blocks = blocks
    return parallel


def _tensor_parallel(model: nn.Module, env: DistEnv) -> dict[str, Split]:
    if env.tp == 1:
        return {}
    split = splits(model)
    if not split:
        raise ConfigError(f"distributed.tp={env.tp}: this recipe's model has no tensor-parallel layers")
    unmark_whole_parameters(model)
    return split


def _shard(
    model: nn.Module, runtime: Runtime, env: DistEnv, cfg: DistributedConfig, block_classes: list[type]
) -> Parallel:
    if runtime.parallel == ParallelBackend.fsdp2:
        from core.parallel.fsdp2 import FSDP2

        units = _unit_classes(cfg.fsdp2.fsdp_unit_modules, block_classes)
        return FSDP2(model, env, cfg.fsdp2, units, runtime.param_dtype)
    _to_param_dtype(model, runtime.param_dtype)  # DDP and Megatron-FSDP compute with the model's own parameter dtype
    if runtime.parallel == ParallelBackend.ddp:
        from core.parallel.ddp import DDP

        return DDP(model, env, cfg.ddp)
    from core.parallel.mfsdp import MegatronFSDP

    return MegatronFSDP(
        model,
        env,
        cfg.mfsdp,
        _unit_classes(cfg.mfsdp.fsdp_unit_modules, block_classes),
        cuda_graph_mode=runtime.cuda_graphs,
    )


def _to_param_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype), except that frozen parameters stored narrower stay so (finetune.mode=lora keeps them in the
    forward's compute dtype: core/training/finetune.py)."""
    narrower = [
        (p, p.dtype)
        for p in model.parameters()
        if not p.requires_grad and p.is_floating_point() and p.dtype.itemsize < dtype.itemsize
    ]
    model.to(dtype)
    for p, stored in narrower:
        p.data = p.data.to(stored)


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
