"""The interface every data-parallel backend offers the training loop."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from core.layers.tensor_parallel import use_full_layout


class Parallel:
    """A model wrapped for data-parallel training.

    `wrapped` is what the loop calls forward on (the backend's wrapper); `model` is the user's model
    (parameter names without any wrapper prefix: the canonical names for optimizer groups and
    checkpoints). With tensor parallelism, `glu` names the GLU fc1 weights, whose state dict entries are
    described to DCP in their TP=1 layout (see core/layers/tensor_parallel.py).
    """

    def __init__(self, wrapped: nn.Module, model: nn.Module):
        self.wrapped = wrapped
        self.model = model
        self.tp_size = 1
        self.glu: set[str] = set()
        self.blocks: list[str] = []  # the transformer blocks' module names, in order (finetune.layer_decay)
        self._by_sharding: Optional[dict[tuple, list[nn.Parameter]]] = None

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(canonical name, parameter the optimizer must update)."""
        return self.model.named_parameters()

    def finalize_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hook for backends that wrap the optimizer (Megatron-FSDP)."""
        return optimizer

    def micro_batch(self, is_last: bool) -> ContextManager:
        """Context for one micro-batch's forward and backward: gradient reduction is only needed
        after the last micro-batch of an optimizer step."""
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """Reduce over data-parallel ranks the gradients that micro-batches run with micro_batch(is_last=False)
        have accumulated, as the last micro-batch's backward otherwise does; call finish_grad_sync after it. A
        CUDA graph records no collective, so a graphed step runs every micro-batch as one that does not reduce
        and calls this after the last (core/training/cuda_graphs.py)."""
        raise NotImplementedError(f"{type(self).__name__} reduces gradients in the last micro-batch's backward only")

    def finish_grad_sync(self) -> None:
        """Make the reduced gradients available on the optimizer's parameters."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to max_norm (0: no clipping); return the norm before clipping.

        Sums the squares of each rank's local gradient pieces, per kind of sharding, and reduces each sum
        over the mesh dimensions that shard it (a replica, e.g. over tensor-parallel ranks, counts once).
        Works alike for plain tensors (DDP), even DTensor shards (FSDP2, 1-D or with TP 2-D) and Megatron-
        FSDP's uneven ones, where a rank may hold no piece of a parameter (its .grad is then None)."""
        by_sharding = self._params_by_sharding()
        local: list[torch.Tensor] = []
        sums = []
        for groups, params in by_sharding.items():  # the same keys in the same order on every rank
            grads = [
                g._local_tensor if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None
            ]
            grads = [g for g in grads if g.numel()]
            local += grads
            sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
            if grads:
                sq = torch.stack(torch._foreach_norm(grads)).float().square().sum()
            for group in groups:
                dist.all_reduce(sq, group=group)
            sums.append(sq)
        norm = torch.stack(sums).sum().sqrt()
        if max_norm > 0 and local:
            torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def _params_by_sharding(self) -> dict[tuple, list[nn.Parameter]]:
        """The parameters grouped by the process groups that shard them (worked out once: they do not change)."""
        if self._by_sharding is None:
            self._by_sharding = {}
            for _, p in self.named_parameters():
                groups = ()
                if isinstance(p, DTensor):  # (FSDP2's _StridedShard shards too, though is_shard() says no)
                    groups = tuple(
                        p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if not pl.is_replicate()
                    )
                    # (a one-rank group has nothing to add, though its all-reduce would still launch a kernel)
                    groups = tuple(g for g in groups if dist.get_world_size(g) > 1)
                self._by_sharding.setdefault(groups, []).append(p)
        return self._by_sharding

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self) -> dict:
        """Sharded model weights for DCP, by canonical name (TE's `_extra_state` left out: the
        checkpointer keeps it separately, for every backend alike); DCP fills them in place on load."""
        state = self._model_state_dict()
        for name in self.glu & set(state):
            use_full_layout(state[name], self.tp_size)
        return state

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Sharded optimizer state for DCP, keyed by canonical parameter name."""
        state = self._optimizer_state_dict(optimizer)
        for name in self.glu & set(state["state"]):
            for value in state["state"][name].values():
                if isinstance(value, DTensor) and value.dim() >= 1:  # exp_avg and the like, not the step count
                    use_full_layout(value, self.tp_size)
        return state

    def _model_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: v for k, v in get_model_state_dict(self.wrapped).items() if not k.endswith("_extra_state")}

    def load_model_state_dict(self, state: dict) -> None:
        """Load the given entries of `model_state_dict()` (possibly a subset) into the model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.wrapped, state, options=StateDictOptions(strict=False))

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.wrapped, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.wrapped, optimizer, state)
