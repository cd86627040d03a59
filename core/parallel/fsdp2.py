"""torch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded as DTensors."""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from core.config import FSDP2Config
from core.distributed import DistEnv
from core.parallel.base import Parallel
from core.precision import DTYPES


class FSDP2(Parallel):
    name = "fsdp2"

    def __init__(self, model: nn.Module, env: DistEnv, cfg: FSDP2Config, unit_modules: list[type],
                 param_dtype: str):
        if env.tp > 1:
            raise NotImplementedError("fsdp2 with distributed.tp > 1 is not supported by this recipe")
        # 1-d mesh (FSDP) or 2-d (HSDP: replicate over dp_outer, shard over dp_shard).
        mesh = env.mesh["dp_outer", "dp_shard"] if env.dp_outer > 1 else env.mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
        units = tuple(unit_modules)
        for module in model.modules():
            if units and isinstance(module, units):
                fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        super().__init__(model, model)

    def micro_batch(self, is_last: bool) -> ContextManager:
        # Reduce-scatter gradients only after the last micro-batch; before that they accumulate unsharded.
        self.module.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()
