"""Tensor parallelism (`distributed.tp`): which parameters are split over the tensor-parallel ranks, and
how a rank's piece maps into the full tensor that initialisation and checkpoints use.

Layers mark a split parameter the way Megatron and TransformerEngine do: `tensor_model_parallel = True`
and `partition_dim` (0: output rows, a column-parallel layer; 1: input columns, a row-parallel layer).
Rank r holds block r of that dimension - with one exception: a GLU MLP's fc1 (swiglu, geglu, ...).
TE keeps fc1 as [gate; up] and splits each half, so rank r holds [gate_r; up_r], and the ranks' blocks
joined in order are not the TP=1 tensor. The full tensor we initialise from and checkpoint is always
the TP=1 layout [gate; up]; `use_full_layout` tells DCP where each local row of such a tensor lies in
it, so a checkpoint written at one TP size loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

# TE's gated activations: fc1 computes [gate; up].
GLU_ACTIVATIONS = frozenset({"geglu", "reglu", "swiglu", "qgeglu", "sreglu", "clamped_swiglu"})


@dataclass(frozen=True)
class TensorParallel:
    """This rank's tensor-parallel group, as the layers need it."""

    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None

    def layer_kwargs(self) -> dict[str, Any]:
        """Constructor arguments that make a TE TransformerLayer (or its twin) tensor-parallel."""
        if self.size == 1:
            return {}
        return {"set_parallel_mode": True, "tp_group": self.group, "tp_size": self.size}


@dataclass(frozen=True)
class Split:
    dim: int  # the dimension split over the ranks
    glu: bool  # rows are [gate; up], each half split separately (dim 0)


def mark_split(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Mark a parameter as split along `dim`, with the attributes TE and Megatron-FSDP read."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    return param


def _splits_parameters(module: nn.Module) -> bool:
    """Whether the module holds tensor-parallel blocks: TE marks the weights of every Linear as split,
    also without a parallel mode (then they are whole), so the module's own settings decide."""
    if getattr(module, "tp_size", 1) <= 1:
        return False
    return getattr(module, "parallel_mode", None) in ("column", "row") or bool(
        getattr(module, "set_parallel_mode", False)
    )


def splits(model: nn.Module) -> dict[str, Split]:
    """The split parameters of `model` by name."""
    out = {}
    for module_name, module in model.named_modules():
        if not _splits_parameters(module):
            continue
        glu = getattr(module, "activation", None) in GLU_ACTIVATIONS
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", -1) >= 0:
                full_name = f"{module_name}.{name}" if module_name else name
                out[full_name] = Split(param.partition_dim, glu and name.startswith("fc1_"))
    return out


def unmark_whole_parameters(model: nn.Module) -> None:
    """Clear the split mark of parameters that are whole (e.g. a TE Linear without parallel mode), so that
    Megatron-FSDP keeps them replicated over the tensor-parallel ranks."""
    for module in model.modules():
        if not _splits_parameters(module):
            for param in module.parameters(recurse=False):
                if getattr(param, "tensor_model_parallel", False):
                    param.tensor_model_parallel = False


def full_numel(model: nn.Module, size: int) -> int:
    """The number of parameters of the whole model (not only this rank's part)."""
    split = splits(model) if size > 1 else {}
    return sum(p.numel() * (size if name in split else 1) for name, p in model.named_parameters())


def full_shape(local_shape: torch.Size, split: Optional[Split], size: int) -> torch.Size:
    if split is None:
        return torch.Size(local_shape)
    shape = list(local_shape)
    shape[split.dim] *= size
    return torch.Size(shape)


def local_part(full: torch.Tensor, split: Optional[Split], rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of the full (TP=1 layout) tensor."""
    if split is None or size == 1:
        return full
    if split.glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]))
    return full.chunk(size, dim=split.dim)[rank]


def full_rows(start: int, length: int, total: int, size: int) -> list[tuple[int, int, int]]:
    """For local GLU rows held at rows [start, start + length) of the ranks' blocks joined in order,
    the runs (offset in those local rows, row in the full [gate; up] tensor, run length)."""
    half = total // 2 // size  # rows of one half on one rank
    runs: list[tuple[int, int, int]] = []
    row = start
    while row < start + length:
        rank, within = divmod(row, 2 * half)
        if within < half:
            target, left = rank * half + within, half - within  # the gate half
        else:
            target, left = total // 2 + rank * half + within - half, 2 * half - within  # the up half
        n = min(left, start + length - row)
        if runs and runs[-1][1] + runs[-1][2] == target:  # continues the previous run (e.g. TP=1)
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((row - start, target, n))
        row += n
    return runs


def use_full_layout(value: torch.Tensor, size: int) -> None:
    """Describe a GLU tensor's local rows to DCP as pieces of the full [gate; up] tensor.

    `value` is a DTensor (a parameter or its optimizer state) whose rows follow the ranks' blocks joined in
    order; its local tensor gets the hooks DCP calls to list, write and read a tensor's pieces."""
    local = value._local_tensor
    pieces = getattr(local, "_full_layout_pieces", None)
    if pieces is None:
        (chunk,) = value.__create_chunk_list__()  # where the local rows lie among the joined blocks
        pieces = []
        if local.numel():
            for offset, row, n in full_rows(chunk.offsets[0], chunk.sizes[0], value.shape[0], size):
                pieces.append(
                    (
                        offset,
                        ChunkStorageMetadata(torch.Size([row, *chunk.offsets[1:]]), torch.Size([n, *chunk.sizes[1:]])),
                    )
                )
    attach_pieces(local, pieces, value.shape)


def attach_pieces(local: torch.Tensor, pieces: list[tuple[int, ChunkStorageMetadata]], global_shape) -> None:
    """Give `local` DCP's chunk hooks for `pieces`: (first local row, where the rows lie in the full tensor)."""
    rows = {tuple(chunk.offsets): (offset, chunk) for offset, chunk in pieces}

    def chunk_list() -> list[ChunkStorageMetadata]:
        return [chunk for _, chunk in pieces]

    def write_items(fqn: str, tensor: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(global_shape)),
            )
            for _, chunk in pieces
        ]

    def tensor_shard(index: MetadataIndex) -> torch.Tensor:
        offset, chunk = rows[tuple(index.offset)]
        return local.narrow(0, offset, chunk.sizes[0])

    local._full_layout_pieces = pieces
    local.__create_chunk_list__ = chunk_list
    local.__create_write_items__ = write_items
    local.__get_tensor_shard__ = tensor_shard


def local_pieces(value: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets in the full tensor, the local tensor that lies there) for each piece this rank holds;
    the local tensors are views, so writing into them writes into `value`."""
    if not isinstance(value, DTensor):
        return [((0,) * value.dim(), value)]
    local = value._local_tensor
    chunks = value.__create_chunk_list__()
    if hasattr(local, "__get_tensor_shard__"):
        return [(tuple(c.offsets), local.__get_tensor_shard__(MetadataIndex("", c.offsets))) for c in chunks]
    if local.numel() == 0:
        return []
    (chunk,) = chunks  # a DTensor's own shard, or Megatron-FSDP's uneven one
    return [(tuple(chunk.offsets), local.view(chunk.sizes))]
