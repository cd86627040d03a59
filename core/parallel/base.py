"""The interface every data-parallel backend offers the training loop."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch
from torch import nn


class Parallel:
    """A model wrapped for data-parallel training.

    `module` is what the loop calls forward on; `inner` is the user's model (parameter names without
    any wrapper prefix: the canonical names for optimizer groups and checkpoints).
    """

    name = ""

    def __init__(self, module: nn.Module, inner: nn.Module):
        self.module = module
        self.inner = inner

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(canonical name, parameter the optimizer must update)."""
        return self.inner.named_parameters()

    def finalize_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook for backends that wrap the optimizer (Megatron-FSDP)."""
        return optimizer

    def micro_batch(self, is_last: bool) -> ContextManager:
        """Context for one micro-batch's forward and backward: gradient reduction is only needed
        after the last micro-batch of an optimizer step."""
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Make the reduced gradients available on the optimizer's parameters."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to max_norm (0: no clipping); return the norm before clipping."""
        params = [p for _, p in self.named_parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        return full_tensor(norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self) -> dict:
        """Sharded model weights for DCP, by canonical name (TE's `_extra_state` left out: the
        checkpointer keeps it separately, for every backend alike)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: v for k, v in get_model_state_dict(self.module).items() if not k.endswith("_extra_state")}

    def load_model_state_dict(self, state: dict) -> None:
        """Load the given entries of `model_state_dict()` (possibly a subset) into the model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(strict=False))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Sharded optimizer state for DCP, keyed by canonical parameter name."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model weights by canonical name, on the CPU, on every rank (a collective)."""
        return {k: full_tensor(v).detach().cpu() for k, v in self.inner.state_dict().items()
                if not k.endswith("_extra_state")}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); a plain tensor unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
