"""`training.compile=true`: torch.compile every transformer block's forward.

Compiling block by block (not the whole model) keeps the data-parallel backend's per-block hooks
(parameter gathers, gradient reduction) outside the compiled graphs, keeps compile time to one block
shape, and leaves parameter names, and so checkpoints, unchanged: only `block.forward` is replaced.
Inductor then fuses the plain-torch blocks' norms, activations, dropout and residual adds into a few
kernels. TransformerEngine's modules are not traced by Dynamo (TE disables it on its own code), so with
TE blocks only the glue between them is compiled: measure before relying on it.
"""

from __future__ import annotations

import torch
from torch import nn


def apply(model: nn.Module, block_classes: list[type]) -> int:
    """Compile the forward of every module of `block_classes` in `model` (after activation
    checkpointing, so the recomputation is compiled too); return how many."""
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_classes))]
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)
