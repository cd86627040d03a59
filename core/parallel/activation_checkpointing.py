"""Activation checkpointing (`training.activation_checkpointing=true`): each transformer block keeps only its
input in the forward pass and recomputes its activations in the backward pass - less memory for about
one more forward pass of compute, which lets larger micro-batches fit.

Applied before sharding by wrapping each block's `forward` in place, so parameter names (and checkpoints)
stay as they are and the data-parallel backend's hooks still run around every block call (FSDP2 and
Megatron-FSDP gather a block's parameters again for its backward pass, when the recomputation runs).
The layer namespace supplies the checkpoint function: TE blocks use TE's own, which keeps FP8 scaling
state from being updated twice.
"""

from __future__ import annotations

import functools
from typing import Callable

from torch import nn


def apply(model: nn.Module, block_classes: list[type], checkpoint: Callable) -> int:
    """Checkpoint every module of `block_classes` in `model` with `checkpoint(forward, *args, **kwargs)`;
    return how many."""
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_classes))]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward)
    return len(blocks)
