"""The one place that chooses between TransformerEngine layers and their plain-torch twins.

Models never import transformer_engine themselves: they take a `Layers` namespace and build
`layers.Linear`, `layers.LayerNorm`, `layers.TransformerLayer`, ... from it. `get_layers` gives the
namespace of the resolved `model.backend` (core/runtime.py decides it):
  te    - transformer_engine.pytorch (CUDA only; FP8 capable)
  torch - core.layers.torch_twins (any device; same parameter names and numerics)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager

import torch
import torch.utils.checkpoint

from core.layers import te_transformer_layer, torch_twins
from core.layers.context_parallel import ContextParallel
from core.layers.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class Layers:
    name: str  # "te" or "torch"
    Linear: type
    LayerNorm: type
    RMSNorm: type
    LayerNormLinear: type
    LayerNormMLP: type
    TransformerLayer: type
    RotaryPositionEmbedding: type  # no parameters: forward(seq_len) -> angles for TransformerLayer(rotary_pos_emb=)
    # Context that runs the enclosed modules outside FP8 (e.g. a classifier head whose size is not a
    # multiple of 16); a no-op for the torch backend.
    high_precision: Callable[[], ContextManager]
    # (logits [..., vocab], labels [...]) -> fp32 cross-entropy per label; TE's fuses the softmax,
    # its gradient and the fp32 upcast into one pass over the (bf16) logits.
    token_cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # checkpoint(function, *args) -> function(*args), its activations recomputed in the backward pass
    # (TE's own keeps FP8 scaling state from being updated twice).
    checkpoint: Callable
    # The KV cache of generation, passed to TransformerLayer(inference_params=) (te.InferenceParams' API).
    InferenceParams: type
    # The tensor-parallel group: models pass `tp.layer_kwargs()` to the layers that support it.
    tp: TensorParallel = field(default_factory=TensorParallel)
    # The context-parallel group: models running on a share of each sequence take its positions from it.
    cp: ContextParallel = field(default_factory=ContextParallel)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_autocast(enabled: bool, recipe=None, amax_reduction_group=None) -> ContextManager:
    """TE's FP8 autocast: `te.autocast` (TE >= 2.8), or `te.fp8_autocast` in older containers."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)


def _te_layers() -> Layers:
    import transformer_engine.pytorch as te

    # te.TransformerLayer, two kernel-level speed-ups (core/layers/te_transformer_layer.py).
    return Layers(
        "te",
        te.Linear,
        te.LayerNorm,
        te.RMSNorm,
        te.LayerNormLinear,
        te.LayerNormMLP,
        te_transformer_layer.te_transformer_layer_class(),
        te.RotaryPositionEmbedding,
        lambda: te_autocast(enabled=False),
        _te_token_cross_entropy,
        functools.partial(te.checkpoint, use_reentrant=False),
        te.InferenceParams,
    )


def _te_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    import transformer_engine.pytorch as te

    # overwrite_input: the backward writes the gradient into the logits' memory (nothing reads the
    # logits after the loss) instead of allocating another logits-sized tensor.
    flat = logits.reshape(-1, 1, logits.shape[-1])
    return te.parallel_cross_entropy(flat, labels.reshape(-1), overwrite_input=True).view(labels.shape)


TORCH_LAYERS = Layers(
    "torch",
    torch_twins.Linear,
    torch_twins.LayerNorm,
    torch_twins.RMSNorm,
    torch_twins.LayerNormLinear,
    torch_twins.LayerNormMLP,
    torch_twins.TransformerLayer,
    torch_twins.RotaryPositionEmbedding,
    contextlib.nullcontext,
    torch_twins.token_cross_entropy,
    functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
    torch_twins.InferenceParams,
)


def te_wgrad_fusable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The TE layers of `model` that can write their weight gradients straight into the parameter's fp32
    main gradient (Megatron-FSDP's `get_main_grad()` buffer) from the wgrad GEMM, instead of returning a
    bf16 gradient that Megatron-FSDP then adds into that buffer in a separate kernel: set their
    `fuse_wgrad_accumulation = True`. TE reads that attribute at every forward, so setting it after
    construction is the same as passing it to the constructor. Empty without TransformerEngine layers."""
    if not te_available():
        return []
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    # Weights split into several parameters (fuse_qkv_params=false) reach TE's GEMM concatenated, as a
    # tensor that has no main gradient of its own: those modules keep their unfused path.
    return [
        m
        for m in model.modules()
        if isinstance(m, TransformerEngineBaseModule)
        and hasattr(m, "fuse_wgrad_accumulation")
        and len(getattr(m, "weight_names", ())) <= 1
    ]


def get_layers(backend: str, tp: TensorParallel = TensorParallel(), cp: ContextParallel = ContextParallel()) -> Layers:
    """The layers of a resolved `model.backend` (te or torch); `tp` and `cp` are this rank's tensor- and
    context-parallel groups."""
    if backend not in ("te", "torch"):
        raise ValueError(f"get_layers({backend!r}): expected a resolved layer backend, te or torch")
    return replace(_te_layers() if backend == "te" else TORCH_LAYERS, tp=tp, cp=cp)
