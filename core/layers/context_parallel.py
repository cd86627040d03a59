"""Context parallelism's arithmetic: which tokens of a sequence each of `cp_size` ranks holds, and self-attention
over the whole sequence computed from each rank's share.

A sequence of length L is cut into 2 x cp_size equal chunks; rank r holds chunk r and chunk 2 x cp_size - 1 - r,
in that order. Under a causal mask the late chunks see more keys than the early ones, so pairing one of each gives
every rank the same work. It is the split Megatron-LM hands TransformerEngine's context-parallel attention,
whose causal kernels assume it, so a model built on either layer backend sees the same tokens per rank. Packed
rows (THD) split each sequence so; their lengths must be multiples of 2 x cp_size.

The attention here is the plain-torch one (`attend_over_context`): each rank gathers every rank's keys and values
and attends with its own queries, masked by global positions (and sequences). It is exact, and the reference
for faster kernels, not one of them: it holds the whole sequence's keys and values on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.config.errors import ConfigError


def load_balanced_positions(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions (int64, [length / cp_size]) of a sequence of `length` that rank `cp_rank` of `cp_size` holds."""
    chunks = 2 * cp_size
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of {cp_size}")
    if length % chunks:
        raise ValueError(
            f"a sequence of {length} tokens does not split into 2 x {cp_size} equal chunks for context parallelism "
            f"(make its length a multiple of {chunks})"
        )
    size = length // chunks
    first = torch.arange(cp_rank * size, (cp_rank + 1) * size, device=device)
    return torch.cat([first, first + (chunks - 1 - 2 * cp_rank) * size])


def packed_load_balanced_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """For packed sequences at offsets `cu_seqlens` [sequences + 1] (empty ones allowed): the indices into the packed
    stream that rank `cp_rank` holds, each sequence split as `load_balanced_positions` splits one, in stream order
    of the sequences. The rank's own cu_seqlens are `cu_seqlens // cp_size`."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of {cp_size}")
    chunks = 2 * cp_size
    offsets = cu_seqlens.long()
    lengths = offsets.diff()
    if bool((lengths % chunks).any()):
        bad = int(lengths[lengths % chunks != 0][0])
        raise ValueError(
            f"a packed sequence of {bad} tokens does not split into 2 x {cp_size} equal chunks for context "
            f"parallelism (pad each sequence to a multiple of {chunks})"
        )
    size = lengths // chunks  # each sequence's chunk
    held = 2 * size  # tokens of each sequence on this rank
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), held)
    within = torch.arange(sequence.numel(), device=offsets.device) - (torch.cumsum(held, 0) - held)[sequence]
    chunk_size = size[sequence]
    late = within >= chunk_size  # the rank's second chunk of that sequence
    start = torch.where(late, (chunks - 1 - cp_rank) * chunk_size - chunk_size, cp_rank * chunk_size)
    return offsets[:-1][sequence] + start + within


def padding_multiple(given: int, cp: int, unit: str = "sequence") -> int:
    """What each `unit` of a packed row is padded to a multiple of: `given` (data.pad_sequences_to_multiple_of), or
    2 x cp where that is 1 and cp > 1: context parallelism cuts every one into 2 x cp equal chunks. ConfigError
    where `given` is no multiple of 2 x cp."""
    multiple = 2 * cp if cp > 1 and given == 1 else given
    if multiple % (2 * cp if cp > 1 else 1):
        raise ConfigError(
            f"data.pad_sequences_to_multiple_of={given} with distributed.cp={cp}: context parallelism cuts each "
            f"{unit} into 2 x {cp} equal chunks; give a multiple of {2 * cp} (or 1)"
        )
    return multiple


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group (`distributed.cp`), as models and layers need it."""

    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None
    ranks: tuple[int, ...] = ()  # the group's global ranks, in group order (TE's cp_global_ranks)

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The positions this rank holds of a sequence of `length` tokens."""
        return load_balanced_positions(length, self.size, self.rank, device)

    def share(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x`, whose dimension `dim` holds whole sequences."""
        if self.size == 1:
            return x
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def apply(self, model: torch.nn.Module, layer_class: type) -> None:
        """Make every `layer_class` (TE's TransformerLayer or its twin) of `model` attend over the whole group's
        tokens: TE's `set_context_parallel_group`, which the twin's TransformerLayer takes alike."""
        if self.size == 1:
            return
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # TE's ring overlaps on it
        for module in model.modules():
            if isinstance(module, layer_class):
                module.set_context_parallel_group(self.group, list(self.ranks), stream, "p2p")


def _all_gathered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` joined along `dim` in rank order (no gradient)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class _GatherAlong(torch.autograd.Function):
    """Every rank's `x`, joined along `dim` in rank order; the gradient of each rank's part is the sum of what every
    rank's use of it contributed (all-reduced, then this rank's part: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        return _all_gathered(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may hand the same tensor to others
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x` joined along `dim` (same shape on every rank), differentiable."""
    return _GatherAlong.apply(x, dim, group)


def attend_over_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group,
    causal: bool,
    sequences: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    real: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Self-attention of this rank's queries over the keys and values of every rank in `group`.

    q [batch, heads, s, d], k and v [batch, groups, s, d] (grouped-query attention: heads a multiple of groups):
    this rank's s tokens, at `positions` [s] (their places in the whole row or packed stream, as
    `load_balanced_positions` or `packed_load_balanced_positions` give them); every rank holds the same number.
    `sequences` [s]: each token's sequence in a packed stream (attention stays within one). causal: a token sees
    the tokens at or before its position. `real` [s]: False for padding within a sequence's slot, which no token
    attends to (a padding query sees itself alone). Returns [batch, heads, s, d]."""
    keys, values = gather_along(k, 2, group), gather_along(v, 2, group)
    key_positions = _all_gathered(positions, 0, group)
    mask = None
    if causal:
        mask = key_positions[None, :] <= positions[:, None]
    if sequences is not None:
        same = _all_gathered(sequences, 0, group)[None, :] == sequences[:, None]
        mask = same if mask is None else mask & same
    if real is not None:
        seen = _all_gathered(real, 0, group)[None, :] | (key_positions[None, :] == positions[:, None])
        mask = seen if mask is None else mask & seen
    per_group = q.shape[1] // keys.shape[1]
    if per_group > 1:
        keys, values = keys.repeat_interleave(per_group, dim=1), values.repeat_interleave(per_group, dim=1)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=1.0 / math.sqrt(q.shape[-1])
    )
