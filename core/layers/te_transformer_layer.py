"""te.TransformerLayer as the recipes run it: the same modules and parameter names, two kernels fewer.

1. Q, K and V as views of one packed projection output, with a gradient that needs no copies.
TE 2.20's MultiheadAttention hands the packed QKV output (shape [..., heads, 3, head_dim]) to
DotProductAttention, which splits it with three `select`s. cuDNN's backward writes dQ, dK and dV into
one packed buffer, but autograd's backward of each `select` zero-fills a tensor of the full packed
size, copies one slice into it, and the three results are then added: three fills, three copies and two
adds of the packed size per layer, 11% of 12 bare ViT-B/16 layers' step on an H200 (docs/performance.md).
`PackedQKVSplit` returns the same views; its backward hands back the packed buffer itself when the three
gradients are its slices (they are, from cuDNN), and stacks them otherwise. TE then recognises the views
as the packed layout from their pointers and strides, as its MultiheadAttention relies on whenever RoPE
is applied (the GPT blocks); TE 2.20 marks that detection deprecated in a warning we silence. Should a
later TE drop it, the GPU test against te.TransformerLayer and benchmarks/te_layers.py show it.

2. With bias and GELU (the ViT MLP) outside FP8, TE adds the fc1 bias and applies GELU in a separate
Triton kernel, and their gradients in two more. cuBLASLt can do both in the fc1 GEMM's epilogue and the
GELU gradient in the fc2 dgrad GEMM's (TE's path when NVTE_BIAS_GELU_NVFUSION=0, and under FP8):
~4% faster on 12 ViT-B/16 layers (H200), same math up to bf16 rounding of the pre-activation.
"""

from __future__ import annotations

import functools
import warnings

import torch

# TE 2.20 warns at every attention call that finds a packed layout from q/k/v pointers (see above).
warnings.filterwarnings("ignore", message="Relying on pointer-based detection of packed q/k/v layouts",
                        category=DeprecationWarning)


def _packed_strides(qkv_shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(qkv_shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class PackedQKVSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, dim: int):
        dim = dim % qkv.dim()
        if qkv.shape[dim] != 3:
            raise ValueError(f"the packed QKV tensor has size {qkv.shape[dim]} at dim {dim}, expected 3")
        ctx.dim, ctx.shape = dim, qkv.shape
        return tuple(qkv.select(dim, i) for i in range(3))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return _join(ctx.shape, ctx.dim, dq, dk, dv), None


def _join(shape: torch.Size, dim: int, dq, dk, dv) -> torch.Tensor:
    """The packed gradient: a view of the buffer dq, dk and dv live in when they are its three slices
    (laid out contiguously like the forward's input), a stacked copy otherwise."""
    if _are_slices_of_one_buffer(shape, dim, dq, dk, dv):
        return dq.as_strided(shape, _packed_strides(shape), dq.storage_offset())
    return torch.stack([dq, dk, dv], dim)


def _are_slices_of_one_buffer(shape: torch.Size, dim: int, dq, dk, dv) -> bool:
    strides = _packed_strides(shape)
    slice_strides = strides[:dim] + strides[dim + 1:]
    storage = dq.untyped_storage()
    last_element = dq.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides))
    return (all(g.untyped_storage().data_ptr() == storage.data_ptr() for g in (dk, dv))
            and all(g.dtype == dq.dtype and g.stride() == slice_strides for g in (dq, dk, dv))
            and dk.storage_offset() - dq.storage_offset() == strides[dim]
            and dv.storage_offset() - dq.storage_offset() == 2 * strides[dim]
            and last_element < storage.nbytes() // dq.element_size())


@functools.cache
def te_dot_product_attention_class():
    """TE's DotProductAttention, splitting a packed `qkv_layer` through `PackedQKVSplit` first.

    TE accepts q, k and v that are views of one buffer as the same packed layout (it checks their
    pointers and strides), so the attention kernels and the result are unchanged.
    """
    import transformer_engine.pytorch as te

    class DotProductAttention(te.DotProductAttention):
        def forward(self, query_layer=None, key_layer=None, value_layer=None, *args,
                    qkv_layer=None, qkv_interleave_dim: int = -3, **kwargs):
            if type(qkv_layer) is torch.Tensor:  # not None, not an FP8 tensor
                query_layer, key_layer, value_layer = PackedQKVSplit.apply(qkv_layer, qkv_interleave_dim)
                qkv_layer = None
            return super().forward(query_layer, key_layer, value_layer, *args, qkv_layer=qkv_layer,
                                   qkv_interleave_dim=qkv_interleave_dim, **kwargs)

    return DotProductAttention


@functools.cache
def te_transformer_layer_class():
    """te.TransformerLayer whose self-attention splits packed QKV with `PackedQKVSplit` and whose MLP
    fuses bias and GELU into its GEMMs.

    Same constructor, modules and parameter names as te.TransformerLayer; only the class of
    `self_attention.core_attention` changes (to a subclass that adds no state).
    """
    import transformer_engine.pytorch as te

    attention_class = te_dot_product_attention_class()

    class TransformerLayer(te.TransformerLayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            core_attention = self.self_attention.core_attention
            if type(core_attention) is te.DotProductAttention:
                core_attention.__class__ = attention_class
            # Read by LayerNormMLP.forward (TE's switch for the separate bias+GELU kernel).
            self.layernorm_mlp.bias_gelu_nvfusion = False

    return TransformerLayer
