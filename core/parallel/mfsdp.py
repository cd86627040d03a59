"""Megatron-FSDP: ZeRO 0-3 and HSDP over the ("dp_outer", "dp_shard", "cp", "tp") mesh (sharding over dp_shard x cp).

Follows `fully_shard_model` + an optimizer built over the wrapped module's parameters +
`fully_shard_optimizer`, rather than `fully_shard(model, optimizer)`, because the latter replaces the
optimizer's parameter groups with a single one and so loses weight-decay groups. Two more traps of
the pinned megatron-fsdp (requirements.txt) are handled here; the parity tests check all three:
  * `fully_shard_optimizer` runs one optimizer step on zero gradients to create the optimizer state;
    with AdamW that applies weight decay once and advances the step count. We run it at lr 0 and
    reset the step count, so training starts exactly where a plain optimizer would.
  * ZeRO-1 with `sync_model_each_microbatch=True` accumulates gradients wrongly; we keep it False,
    skip reduction on all but the last micro-batch and call `finish_grad_sync` ourselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from typing import ContextManager

import torch
from torch import nn

from core.config.errors import ConfigError
from core.config.schema import MFSDPConfig
from core.distributed.env import DistEnv
from core.layers.namespace import te_wgrad_fusable_modules
from core.parallel.base import Parallel
from core.training.precision import dtype

log = logging.getLogger(__name__)
# Megatron-FSDP reports every FSDP unit's buffers at INFO (a screenful per model); keep warnings only.
logging.getLogger("megatron_fsdp").setLevel(logging.WARNING)


def use_own_ddp_config_if_needed() -> None:
    """With megatron-core installed, megatron-fsdp builds megatron-core's DistributedDataParallelConfig
    instead of its own, and that class's fields follow megatron-core's version: the megatron-core pinned for
    Python 3.11 (requirements.txt) lacks fields that megatron-fsdp passes, a TypeError in fully_shard_model.
    Where megatron-core's class lacks any of them, give megatron-fsdp back its own class (the one it was
    written against); a megatron-core that has them all is left in use."""
    from megatron_fsdp import distributed_data_parallel_config as bundled

    own = bundled.DistributedDataParallelConfig
    needed = {f.name for f in dataclasses.fields(own)}
    for name in ("fully_shard", "megatron_fsdp", "param_and_grad_buffer"):
        module = importlib.import_module(f"megatron_fsdp.{name}")
        used = getattr(module, "DistributedDataParallelConfig", own)
        if used is not own and not needed <= {f.name for f in dataclasses.fields(used)}:
            module.DistributedDataParallelConfig = own


def _fuse_te_wgrad_accumulation(model: nn.Module, zero: int, dp_shard: int) -> None:
    """Let TE's wgrad GEMMs write into Megatron-FSDP's fp32 main gradients where that is safe.

    Megatron-FSDP tells TE to overwrite main_grad whenever it gathers parameters (ZeRO 1-3). That is right
    only where main_grad is a fresh bucket per backward, later reduce-scattered and accumulated: ZeRO-2/3
    over more than one dp_shard rank. Where the buffer is the persistent one that adds up the micro-batches
    (ZeRO-1; ZeRO-2/3 with one dp_shard rank, e.g. tensor parallelism only), it would keep only the last
    micro-batch. ZeRO-0 gathers nothing, so TE accumulates there."""
    fusable = te_wgrad_fusable_modules(model)
    if not fusable:
        return
    if zero == 0 or (zero >= 2 and dp_shard > 1):
        for module in fusable:
            module.fuse_wgrad_accumulation = True
        log.info("TE writes weight gradients into Megatron-FSDP's main gradients (%d modules)", len(fusable))
    else:
        log.warning(
            "distributed.mfsdp.te_fuse_wgrad_accumulation is off for ZeRO-%d over %d dp_shard "
            "rank(s): Megatron-FSDP would make TE overwrite the gradients accumulated over "
            "earlier micro-batches",
            zero,
            dp_shard,
        )


class MegatronFSDP(Parallel):
    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        cfg: MFSDPConfig,
        unit_modules: list[type | str],
        cuda_graph_mode: bool = False,
    ):
        import megatron_fsdp

        use_own_ddp_config_if_needed()

        if cfg.zero_dp_strategy >= 2 and not unit_modules:
            raise ConfigError("distributed.mfsdp.zero_dp_strategy>=2 needs fsdp_unit_modules")
        hsdp = env.dp_outer > 1
        zero = int(cfg.zero_dp_strategy)
        if env.world_size == 1 and zero > 0:
            # One rank: nothing to shard, so every ZeRO level trains the same; ZeRO-0 skips the per-block
            # gather and reduce hooks (faster: docs/performance.md).
            log.info("one GPU: Megatron-FSDP runs ZeRO-0 (zero_dp_strategy=%d has nothing to shard)", zero)
            zero = 0
        if cfg.te_fuse_wgrad_accumulation:
            _fuse_te_wgrad_accumulation(model, zero, env.dp_shard * env.cp)
        policy = megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=dtype(cfg.main_params_dtype),
            main_grads_dtype=dtype(cfg.main_grads_dtype),
            grad_comm_dtype=dtype(cfg.grad_comm_dtype),
        )
        wrapper = megatron_fsdp.fully_shard_model(
            model,
            device_mesh=env.mesh,
            # With context parallelism, over the flattened dp_shard x cp ranks (core/distributed/env.py).
            dp_shard_dim="dp_shard_cp" if env.cp > 1 else "dp_shard",
            dp_outer_dim="dp_outer" if hsdp else None,
            tp_dim="tp",
            hybrid_fsdp_group=env.dp_cp_group if hsdp else None,
            fsdp_unit_modules=unit_modules,
            zero_dp_strategy=zero,
            outer_dp_sharding_strategy=int(cfg.outer_dp_sharding_strategy),
            device=env.device,
            init_model_with_meta_device=cfg.init_model_with_meta_device,
            mixed_precision_policy=policy,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            overlap_param_gather=cfg.overlap_param_gather,
            sync_model_each_microbatch=cfg.sync_model_each_microbatch,
            preproc_state_dict_for_dcp_ckpt=cfg.preproc_state_dict_for_dcp_ckpt,
            report_nan_in_param_grad=cfg.report_nan_in_param_grad,
            average_in_collective=cfg.average_in_collective,
            disable_bucketing=cfg.disable_bucketing,
            keep_fp8_transpose_cache=cfg.keep_fp8_transpose_cache,
            nccl_ub=cfg.nccl_ub,
            fsdp_double_buffer=cfg.fsdp_double_buffer,
            # Keeps the gradients' storage in place across zero_grad, where a CUDA graph writes them
            # (training.cuda_graphs).
            cuda_graph_mode=cuda_graph_mode,
        )
        self.cfg = cfg
        self.zero = zero  # in effect (one rank runs ZeRO-0)
        # One data-parallel rank without sharding: the gradients are already complete in the main-gradient
        # buffer, and "reducing" them would only copy 4 bytes per parameter through a one-rank all-reduce.
        self.nothing_to_reduce = zero == 0 and env.dp_cp_size == 1
        self._reduction_order: list | None = None  # reduce_gradients' parameters, listed at its first call
        # wrapper.module is the user's model; its parameters are now Megatron-FSDP's distributed
        # (DTensor) optimizer parameters under their original names.
        super().__init__(wrapper, wrapper.module)

    def finalize_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        import megatron_fsdp

        lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # the pre-init step must not move (or decay) any weight
        megatron_fsdp.fully_shard_optimizer(
            optimizer, preproc_state_dict_for_dcp_ckpt=self.cfg.preproc_state_dict_for_dcp_ckpt
        )
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for state in optimizer.state.values():
            if "step" in state:  # that step must not count for Adam's bias correction either
                state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
        return optimizer

    def micro_batch(self, is_last: bool) -> ContextManager:
        if not is_last or self.nothing_to_reduce:
            return self.wrapped.no_sync()
        # The root post-backward hook reduces gradients (ZeRO 0/1) only when this flag is set.
        self.wrapped.is_last_microbatch = True
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        if self.nothing_to_reduce:
            return
        if self.zero >= 2:  # they reduce-scatter in every micro-batch's backward, no_sync or not
            raise RuntimeError(
                f"Megatron-FSDP ZeRO-{self.zero} reduces gradients during each backward; "
                "deferring the reduction needs ZeRO-0 or ZeRO-1"
            )
        # What the root post-backward hook does for the parameters still waiting on a step's last micro-batch
        # (megatron_fsdp.py, _root_post_backward), for every parameter: each bucket's all-reduce (ZeRO-0) or
        # reduce-scatter (ZeRO-1), in the same buckets and order as the hooks, so the sums are the same.
        wrapped = self.wrapped
        if self._reduction_order is None:
            self._reduction_order = sorted(wrapped.param_to_name, key=wrapped.param_to_name.get)
        wrapped.grad_reduce_pipeline.reduce_gradients(
            self._reduction_order,
            suggested_queue_capacity=wrapped.suggested_RS_queue_capacity,
            outer_fsdp_group_grad_reduce=wrapped.dist_index.use_hybrid_fsdp,
        )
        wrapped.grad_reduce_pipeline.reset()

    def finish_grad_sync(self) -> None:
        self.wrapped.finish_grad_sync()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Gradients are already synchronised (finish_grad_sync, before clipping).
        optimizer.step(sync_grad_before_optimizer_step=False)

    def _model_state_dict(self) -> dict:
        # The wrapper's state-dict hooks prepare the unevenly sharded DTensors for DCP (and drop TE's
        # _extra_state); its keys carry the wrapper's "module." prefix, which we remove.
        return {
            k.removeprefix("module."): v for k, v in self.wrapped.state_dict().items() if not k.endswith("_extra_state")
        }

    def load_model_state_dict(self, state: dict) -> None:
        # The wrapper's load hook copies the loaded main weights into its compute buffers; strict=False
        # because `state` may be a subset (init_from with skipped prefixes) and lacks `_extra_state`.
        self.wrapped.load_state_dict({"module." + k: v for k, v in state.items()}, strict=False)

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        # torch keys optimizer state by parameter index (order of appearance in param_groups);
        # re-key it by parameter name, like torch.distributed.checkpoint.state_dict does for FSDP2.
        sd = optimizer.state_dict()
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        ordered = list(dict.fromkeys(id(p) for g in optimizer.param_groups for p in g["params"]))
        index_to_name = {i: name_of[pid] for i, pid in enumerate(ordered)}
        groups = [{**g, "params": [index_to_name[i] for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": {index_to_name[i]: v for i, v in sd["state"].items()}, "param_groups": groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        # Back from parameter names to torch's indices, in this optimizer's own order (torch matches
        # saved and current parameters by position within each group).
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        current = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        saved = state["param_groups"]
        if len(saved) != len(current) or any(set(s["params"]) != set(c) for s, c in zip(saved, current)):
            raise ValueError("the optimizer's parameter groups differ from the checkpoint's")
        index_of = {n: i for i, n in enumerate(n for names in current for n in names)}
        groups = [{**s, "params": [index_of[n] for n in c]} for s, c in zip(saved, current)]
        optimizer.load_state_dict(
            {"state": {index_of[n]: v for n, v in state["state"].items()}, "param_groups": groups}
        )
