"""One micro-batch's forward and backward, the unit the loop repeats (and training.cuda_graphs replays)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager

import torch

if TYPE_CHECKING:  # the backend's interface, named in annotations only (docs/architecture.md: imports)
    from core.parallel.base import Parallel


class ForwardBackward:
    """Forward the micro-batch through the wrapped model, backward its loss sum scaled by `loss_scale` (a
    device tensor) into the backend's gradient buffers; return the loss sum, detached."""

    def __init__(self, parallel: Parallel, recipe, autocast: Callable[[], ContextManager]):
        self.parallel, self.recipe, self.autocast = parallel, recipe, autocast

    def __call__(self, batch: dict, loss_scale: torch.Tensor, is_last: bool) -> torch.Tensor:
        # is_last: the step's last micro-batch, after whose backward the backend reduces gradients.
        with self.parallel.micro_batch(is_last):
            with self.autocast():
                out = self.recipe.forward(self.parallel.wrapped, batch, training=True)
            loss = out["loss"].sum()
            (loss * loss_scale).backward()
        return loss.detach()
