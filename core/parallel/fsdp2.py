"""torch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded as DTensors.

With tensor parallelism, the tensor-parallel parameters become DTensors over the "tp" mesh dimension
first (each rank's block, as the layers built it); FSDP2 then shards them over the data-parallel
dimensions too, a 2-D layout that DCP reshards to any other mesh. Parameters the layers keep whole
(norms, embedding) are sharded over the data-parallel dimensions only."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from core.config.schema import FSDP2Config
from core.distributed.env import DistEnv
from core.parallel.base import Parallel
from core.training.precision import DTYPES


class FSDP2(Parallel):
    def __init__(
        self, model: nn.Module, env: DistEnv, cfg: FSDP2Config, unit_modules: list[type], param_dtype: torch.dtype
    ):
        if env.tp > 1:
            _tensor_parallel_as_dtensors(model, env.mesh["tp"])
        # 1-d mesh (FSDP) or 2-d (HSDP: replicate over dp_outer, shard over dp_shard).
        # With context parallelism the weights are sharded over the cp ranks too: they hold different tokens, so
        # their gradients are reduced as data-parallel ones are.
        shard = "dp_shard_cp" if env.cp > 1 else "dp_shard"
        mesh = env.mesh["dp_outer", shard] if env.dp_outer > 1 else env.mesh[shard]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype])
        units = tuple(unit_modules)
        for module in model.modules():
            if units and isinstance(module, units):
                fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        super().__init__(model, model)

    def micro_batch(self, is_last: bool) -> ContextManager:
        # Reduce-scatter gradients only after the last micro-batch; before that they accumulate unsharded.
        self.wrapped.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()


_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _tensor_parallel_as_dtensors(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Replace each tensor-parallel parameter (this rank's block) by a DTensor over the tp mesh."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not getattr(param, "tensor_model_parallel", False):
                continue
            value = DTensor.from_local(param.data, tp_mesh, [Shard(param.partition_dim)], run_check=False)
            new = nn.Parameter(value, requires_grad=param.requires_grad)
            for attr in _TP_ATTRIBUTES:
                setattr(new, attr, getattr(param, attr))
            module.register_parameter(name, new)
