"""Host copies of a (sharded) state dict for a background save (`checkpoint.async_save`).

DCP's own staging copies whole tensor storages, which fails on Megatron-FSDP's state (views into flat
buffers, some freed). `HostStager` copies each local shard instead and keeps its sharding description -
DTensor internals that DCP itself reads (the local tensor and the hooks by which Megatron-FSDP and
core/layers/tensor_parallel.py describe uneven and re-laid-out pieces). This module is the one place
that touches them.
"""

from __future__ import annotations

import copy as copy_module
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from core.layers.tensor_parallel import attach_pieces


class HostStager:
    """Copies a state dict to host memory for a background save, keeping each DTensor's sharding.

    DCP's own staging copies whole tensor storages, which fails on Megatron-FSDP's state (views into
    flat buffers, some freed). We copy each local shard instead and keep the sharding description,
    including the hooks by which Megatron-FSDP tells DCP the offsets of its uneven shards.
    From a GPU the copies go into pinned buffers kept from one save to the next (the previous save has
    finished writing them: Checkpointer._save waits for it first) and run without a sync per tensor, so
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
            if hasattr(local, "_full_layout_pieces"):  # tensor-parallel GLU rows (core/layers/tensor_parallel.py)
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


class AlreadyStaged:
    """DCP AsyncStager protocol for a state dict that HostStager already copied."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
