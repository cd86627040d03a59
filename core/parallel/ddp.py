"""torch DistributedDataParallel: full replicas, gradients all-reduced (averaged) after backward."""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.config.schema import DDPConfig
from core.distributed.env import DistEnv
from core.parallel.base import Parallel


class DDP(Parallel):
    def __init__(self, model: nn.Module, env: DistEnv, cfg: DDPConfig):
        wrapped = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=env.dp_cp_group,  # the ranks holding different tokens (context parallelism too)
            bucket_cap_mb=cfg.bucket_cap_mb,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters,
            static_graph=cfg.static_graph,
        )
        super().__init__(wrapped, model)

    def micro_batch(self, is_last: bool) -> ContextManager:
        # Skip the all-reduce on all but the last micro-batch; gradients accumulate locally.
        return contextlib.nullcontext() if is_last else self.wrapped.no_sync()
