"""training.cuda_graphs=forward_backward: each micro-batch's forward and backward replayed as one CUDA graph.

Why: at the micro-batches people run on many GPUs, a step's GPU work takes less time than the host takes to
launch it (Python running TE modules and Megatron-FSDP hooks), so the GPU waits (docs/performance.md). A CUDA
graph records the kernels of one micro-batch once; afterwards one call launches them all.

How it runs:
- The first `warmup` micro-batches run eagerly: TE, cuBLAS and Megatron-FSDP create workspaces and buffers on
  first use, which must not happen inside a capture. Where a step accumulates gradients over several
  micro-batches, the graph is captured from one that is not the step's last (replayed for the last one too;
  the reverse has not been checked against eager runs).
- The next one is captured (recording runs nothing) and then replayed; every later micro-batch is copied into
  the captured input buffers and replayed. The loss scale is an input too; the loss sum is read from the
  buffer the graph writes it to.
- Gradients land where the eager backward puts them: Megatron-FSDP's gradient buffer, which its
  cuda_graph_mode zeroes in place instead of freeing. Gradient sync, clipping, the NaN guard, the optimizer and
  the schedule stay eager and update the weights in place, where each replay reads them.
- Several data-parallel ranks: every micro-batch, the last included, runs as one that does not reduce (no
  collective in its forward or backward with ZeRO-0), and after the step's last micro-batch the gradients are
  all-reduced eagerly, bucket by bucket as the last backward's hooks would (`Parallel.reduce_gradients`). The
  reduction no longer overlaps the last backward; it is one all-reduce of the gradients per optimizer step.
- A micro-batch whose tensors differ in shape or dtype from the captured one runs eagerly.
- The host keeps at most `REPLAYS_AHEAD` replays queued that the GPU has not finished (`QueueBound`): a graph
  launched into a full queue blocks in the driver, and while it does, CUDA calls of the process's other threads
  wait too; the GPU JPEG decoder makes several per image (docs/performance.md, "Real JPEGs while training").
- TE attention takes a form cuDNN can capture at any sequence length (core/layers/te_transformer_layer.py, 4.),
  in the eager micro-batches too, so that every micro-batch runs the same kernels.
- FP8: delayed scaling's amax reduction and scale update run as kernels on the layers' own amax and scale
  tensors when the FP8 autocast closes and in the backward pass, so they are captured with the micro-batch and
  the replays keep updating the state that checkpoints save. Current scaling keeps no state.
- Activation recomputation runs inside the captured backward.
- Code in the forward or loss that reads a GPU value on the host (.item(), .tolist(), data-dependent shapes)
  cannot be recorded: the capture stops the run with `CaptureFailed`, saying so.

Refused before any work (core/runtime.py): CPU, backends other than Megatron-FSDP, FP8 recipes other than
delayed and current scaling, torch.compile; tensor parallelism; on several data-parallel ranks, ZeRO levels
other than 0 (ZeRO-2/3 reduce-scatter in every backward), HSDP and FP8 (the amax all-reduce inside the graph:
not checked against eager runs). training.cuda_graphs=auto runs those eagerly.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch

from core.training.forward_backward import ForwardBackward

if TYPE_CHECKING:  # the backend's interface, named in annotations only (docs/architecture.md: imports)
    from core.parallel.base import Parallel

log = logging.getLogger("train")

REPLAYS_AHEAD = 2  # one replay running and the next queued keep the GPU busy; graph launches are cheap


class QueueBound:
    """At most `ahead` pieces of the host's work queued on the GPU and not finished: `wait_for_room` before
    queuing one blocks, outside the driver, until the oldest is done; `queued` after it marks its end."""

    def __init__(self, ahead: int, make_event: Optional[Callable[[], Any]] = None):
        if ahead < 1:
            raise ValueError(f"QueueBound: ahead={ahead}, expected at least 1")
        self.ahead = ahead
        # A blocking event: the waiting host thread sleeps instead of spinning on a core the loader workers use.
        self.make_event = make_event or (lambda: torch.cuda.Event(blocking=True))
        self.pending: collections.deque = collections.deque()

    def wait_for_room(self) -> None:
        while len(self.pending) >= self.ahead:
            self.pending.popleft().synchronize()

    def queued(self) -> None:
        event = self.make_event()
        event.record()
        self.pending.append(event)


def forward_backward(
    parallel: Parallel, recipe, autocast: Callable[[], ContextManager], graphs: bool, te_layers: bool
) -> ForwardBackward:
    """The loop's micro-batch step: eager, or replayed as a CUDA graph (runtime.cuda_graphs: where it applies,
    core/runtime.py)."""
    if not graphs:
        return ForwardBackward(parallel, recipe, autocast)
    if te_layers:
        from core.layers.te_transformer_layer import use_capturable_attention

        use_capturable_attention(parallel.model)
    return GraphedForwardBackward(parallel, recipe, autocast)


class CaptureFailed(RuntimeError):
    """The forward and backward of a micro-batch did something a CUDA graph cannot record."""


def _signature(batch: dict) -> tuple:
    """What must match for a micro-batch to replay the graph: tensor shapes, dtypes and devices, other values."""
    return tuple((k, (tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else v) for k, v in batch.items())


class GraphedForwardBackward(ForwardBackward):
    def __init__(self, parallel: Parallel, recipe, autocast: Callable[[], ContextManager], warmup: int = 2):
        super().__init__(parallel, recipe, autocast)
        self.warmup = warmup
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.signature: Optional[tuple] = None
        self.inputs: dict[str, Any] = {}  # the captured micro-batch's tensors: replays read them
        self.loss_scale: Optional[torch.Tensor] = None
        self.loss: Optional[torch.Tensor] = None  # the loss sum the graph writes
        self.eager_fallbacks = 0
        self.accumulates = False  # a step has had more than one micro-batch
        self.queue = QueueBound(REPLAYS_AHEAD)

    def __call__(self, batch: dict, loss_scale: torch.Tensor, is_last: bool) -> torch.Tensor:
        loss = self._micro_batch(batch, loss_scale, is_last)
        if is_last:  # after the step's last micro-batch, as its backward would (a no-op on one rank)
            self.parallel.reduce_gradients()
        return loss

    def _micro_batch(self, batch: dict, loss_scale: torch.Tensor, is_last: bool) -> torch.Tensor:
        """The micro-batch's forward and backward, eager or replayed, run as one that does not reduce gradients
        (they are reduced after the step's last: __call__)."""
        self.calls += 1
        self.accumulates |= not is_last
        # One graph serves every micro-batch of a step, so it must be one whose replays were checked against
        # eager ones (GPU tests): a micro-batch before the last where steps accumulate gradients, else a last one.
        if self.calls <= self.warmup or (self.graph is None and is_last and self.accumulates):
            return super().__call__(batch, loss_scale, is_last=False)
        if self.graph is None:
            self._capture(batch, loss_scale)
        elif _signature(batch) != self.signature:
            self.eager_fallbacks += 1
            if self.eager_fallbacks == 1:
                log.warning(
                    "training.cuda_graphs: a micro-batch unlike the captured one (%s) runs eagerly",
                    ", ".join(f"{k} {v[0] if isinstance(v, tuple) else v}" for k, v in _signature(batch)),
                )
            return super().__call__(batch, loss_scale, is_last=False)
        self.queue.wait_for_room()
        for name, value in batch.items():
            if torch.is_tensor(value):
                self.inputs[name].copy_(value, non_blocking=True)
        self.loss_scale.copy_(loss_scale)
        self.graph.replay()
        self.queue.queued()
        return self.loss

    def _capture(self, batch: dict, loss_scale: torch.Tensor) -> None:
        self.signature = _signature(batch)
        self.inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        self.loss_scale = loss_scale.clone()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's and the checkpoint writer's threads keep using CUDA meanwhile.
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.loss = super().__call__(self.inputs, self.loss_scale, is_last=False)
        except RuntimeError as e:  # torch's own message names the operation, not why it matters or what to do
            raise CaptureFailed(
                "training.cuda_graphs: the micro-batch's forward and backward could not be captured as a CUDA "
                f"graph ({type(e).__name__}: {e}). Recording runs nothing, so code that reads a GPU value on "
                "the host (.item(), .tolist(), .cpu(), printing a tensor, a shape that depends on the data such "
                "as boolean indexing) cannot be recorded; keep such code out of the recipe's forward and loss, "
                "or run with training.cuda_graphs=none"
            ) from e
        log.info(
            "training.cuda_graphs: captured the forward and backward of a micro-batch (%s)",
            ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.inputs.items() if torch.is_tensor(v)),
        )
