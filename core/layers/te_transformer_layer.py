"""te.TransformerLayer as the recipes run it: the same modules and parameter names, fewer kernels
(what each change saves: docs/performance.md).

1. Q, K and V as views of one packed projection output, with a gradient that needs no copies.
TE's MultiheadAttention (the pinned TransformerEngine) hands the packed QKV output (shape [..., heads, 3, head_dim]) to
DotProductAttention, which splits it with three `select`s. cuDNN's backward writes dQ, dK and dV into
one packed buffer, but autograd's backward of each `select` zero-fills a tensor of the full packed
size, copies one slice into it, and the three results are then added: three fills, three copies and two
adds of the packed size per layer.
`PackedQKVSplit` returns the same views; its backward hands back the packed buffer itself when the three
gradients are its slices (they are, from cuDNN), and stacks them otherwise. TE then recognises the views
as the packed layout from their pointers and strides, as its MultiheadAttention relies on whenever RoPE
is applied (the GPT blocks); TE marks that detection deprecated in a warning we silence. Should a
later TE drop it, the GPU test against te.TransformerLayer and benchmarks/te_layers.py show it.

2. Attention with RoPE (the GPT blocks; ESM-2's packed sequences) in one kernel each way. TE's MultiheadAttention
splits the projection output [.., groups, (heads per group + 2) x head_dim] into Q, K and V, copies Q into
[.., heads, head_dim], runs one RoPE kernel for Q and one for K, and in the backward runs two RoPE
kernels more and concatenates dQ, dK and dV back with a strided copy. `MultiheadAttention` splits and
rotates the projection output in one kernel instead, and writes the packed gradient in one (`qkv_rope.py`:
TE's fused QKV-RoPE function, what Megatron-Core's `fused_single_qkv_rope` uses, in faster kernels).
Outside that case (FP8 attention, no RoPE, KV cache, context parallelism, QK norms, ...) it is TE's own
forward.

3. With bias and GELU (the ViT MLP) outside FP8, TE adds the fc1 bias and applies GELU in a separate
Triton kernel, and their gradients in two more. cuBLASLt can do both in the fc1 GEMM's epilogue and the
GELU gradient in the fc2 dgrad GEMM's (TE's path when NVTE_BIAS_GELU_NVFUSION=0, and under FP8): the
same math up to bf16 rounding of the pre-activation.

4. Under CUDA-graph capture (training.cuda_graphs), TE does not run cuDNN's fused attention for a
sequence length that is not a multiple of 128 (ViT-B/16's 197) without a padding mask, unless its cuDNN is
9.15.1 or newer; captured anyway, it fails with an illegal memory access. The same attention expressed as a padding
mask whose every sequence has the full length is capturable with older cuDNN too, so capturable attention
(`use_capturable_attention`) passes it that way, in the eager steps as well as in the graph.
"""

from __future__ import annotations

import functools
import warnings

import torch

from core.layers import qkv_rope

# TE warns at every attention call that finds a packed layout from q/k/v pointers (see above).
warnings.filterwarnings(
    "ignore", message="Relying on pointer-based detection of packed q/k/v layouts", category=DeprecationWarning
)


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
    slice_strides = strides[:dim] + strides[dim + 1 :]
    storage = dq.untyped_storage()
    last_element = dq.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides))
    return (
        all(g.untyped_storage().data_ptr() == storage.data_ptr() for g in (dk, dv))
        and all(g.dtype == dq.dtype and g.stride() == slice_strides for g in (dq, dk, dv))
        and dk.storage_offset() - dq.storage_offset() == strides[dim]
        and dv.storage_offset() - dq.storage_offset() == 2 * strides[dim]
        and last_element < storage.nbytes() // dq.element_size()
    )


@functools.cache
def te_dot_product_attention_class():
    """TE's DotProductAttention, splitting a packed `qkv_layer` through `PackedQKVSplit` first.

    TE accepts q, k and v that are views of one buffer as the same packed layout (it checks their
    pointers and strides), so the attention kernels and the result are unchanged.
    """
    import transformer_engine.pytorch as te

    class DotProductAttention(te.DotProductAttention):
        capturable = False  # set by use_capturable_attention (training.cuda_graphs)

        def forward(
            self,
            query_layer=None,
            key_layer=None,
            value_layer=None,
            *args,
            qkv_layer=None,
            qkv_interleave_dim: int = -3,
            **kwargs,
        ):
            if type(qkv_layer) is torch.Tensor:  # not None, not an FP8 tensor
                query_layer, key_layer, value_layer = PackedQKVSplit.apply(qkv_layer, qkv_interleave_dim)
                qkv_layer = None
            if self.capturable:
                kwargs = _as_full_length_padding(self, query_layer, kwargs)
            return super().forward(
                query_layer,
                key_layer,
                value_layer,
                *args,
                qkv_layer=qkv_layer,
                qkv_interleave_dim=qkv_interleave_dim,
                **kwargs,
            )

    return DotProductAttention


# The mask types with a padding twin that cuDNN runs under CUDA-graph capture at any sequence length.
_PADDING_TWIN = {"no_mask": "padding", "causal": "padding_causal"}


def _as_full_length_padding(attention, query, kwargs: dict) -> dict:
    """The same attention as a padding mask whose every sequence has the full length, where that is what
    keeps cuDNN's fused attention under CUDA-graph capture (see 4.); `kwargs` unchanged otherwise."""
    mask = kwargs.get("attn_mask_type") or attention.attn_mask_type
    layout = kwargs.get("qkv_format") or attention.qkv_format
    if (
        mask not in _PADDING_TWIN
        or layout not in ("bshd", "sbhd")
        or type(query) is not torch.Tensor
        or any(
            kwargs.get(k) is not None
            for k in ("attention_mask", "cu_seqlens_q", "cu_seqlens_kv", "inference_params", "core_attention_bias")
        )
    ):
        return kwargs
    batch, seq = (query.shape[0], query.shape[1]) if layout == "bshd" else (query.shape[1], query.shape[0])
    if seq % 128 == 0:
        return kwargs
    from transformer_engine.pytorch.attention.dot_product_attention.utils import get_full_cu_seqlens

    full = get_full_cu_seqlens(batch, seq, query.device)  # cached per shape: made in the eager micro-batches
    return {
        **kwargs,
        "attn_mask_type": _PADDING_TWIN[mask],
        "cu_seqlens_q": full,
        "cu_seqlens_kv": full,
        "max_seqlen_q": seq,
        "max_seqlen_kv": seq,
    }


def use_capturable_attention(model: torch.nn.Module) -> int:
    """Make the TE attention of `model` capturable in a CUDA graph (training.cuda_graphs); returns how many
    attention modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, te_dot_product_attention_class()):
            module.capturable = True
            changed += 1
    return changed


@functools.cache
def te_multihead_attention_class():
    """TE's MultiheadAttention, with Q/K/V split and RoPE fused into one kernel where it can (see 2.)."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention import multi_head_attention
    from transformer_engine.pytorch.cpu_offload import is_cpu_offload_enabled
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    def _fp8_attention_or_custom() -> bool:
        if getattr(multi_head_attention, "_dpa_fp8_recipe", ""):  # NVTE_DPA_FP8_RECIPE overrides the recipe
            return True
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        return recipe.fp8_dpa or recipe.fp8_mha or recipe.custom()

    class MultiheadAttention(te.MultiheadAttention):
        def _fused_qkv_rope_applies(self, kwargs) -> bool:
            return (
                kwargs.get("rotary_pos_emb") is not None
                and kwargs.get("inference_params") is None
                and kwargs.get("encoder_output") is None
                and kwargs.get("thd_attention_policies") is None
                and self.attention_type == "self"
                and self.input_layernorm
                and not self.return_layernorm_output
                and self.qkv_weight_interleaved
                and self._rope_layout_supported(kwargs)
                and self.q_norm is None
                and self.k_norm is None
                and self.cp_size == 1
                and not is_cpu_offload_enabled()
                and not (FP8GlobalStateManager.is_fp8_enabled() and _fp8_attention_or_custom())
            )

        def _rope_layout_supported(self, kwargs) -> bool:
            if self.qkv_format in ("sbhd", "bshd"):
                return True
            # Packed sequences: one cu_seqlens for Q and K, no padding between sequences (TE would rotate by
            # the padded offsets then).
            cu_seqlens = kwargs.get("cu_seqlens_q")
            return (
                self.qkv_format == "thd"
                and cu_seqlens is not None
                and kwargs.get("cu_seqlens_kv") is cu_seqlens
                and not kwargs.get("pad_between_seqs")
                and kwargs.get("cu_seqlens_q_padded") is None
                and kwargs.get("cu_seqlens_kv_padded") is None
            )

        def forward(self, hidden_states, *args, **kwargs):
            # (TransformerLayer passes everything after hidden_states by keyword)
            if args or not self._fused_qkv_rope_applies(kwargs):
                return super().forward(hidden_states, *args, **kwargs)
            return _fused_qkv_rope_forward(self, hidden_states, kwargs)

    return MultiheadAttention


def _fused_qkv_rope_forward(attention, hidden_states, kwargs: dict):
    """TE MultiheadAttention's forward for self-attention with RoPE, its Q/K/V split and rotation in one kernel
    (`qkv_rope.split_rotate`); what the module computes is TE's (see 2.)."""
    rotary_pos_emb = kwargs.pop("rotary_pos_emb")
    is_first_microbatch = kwargs.pop("is_first_microbatch", None)
    softcap = kwargs.pop("softcap", None)
    for unused in ("inference_params", "encoder_output"):  # both None here
        kwargs.pop(unused, None)
    # What TE's forward sets when neither Q/K/V nor the attention output are FP8 (always so here).
    attention._update_output_quantizer_roles(False, False, False)
    groups, head_dim = attention.num_gqa_groups_per_partition, attention.hidden_size_per_attention_head
    per_group = attention.num_attention_heads_per_partition // groups
    qkv = attention.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
    qkv = qkv.view(*qkv.shape[:-1], groups, (per_group + 2) * head_dim)
    q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
    query, key, value = qkv_rope.split_rotate(
        qkv,
        q_freqs,
        k_freqs,
        per_group,
        head_dim,
        attention.qkv_format,
        attention.rotary_pos_interleaved,
        kwargs.get("cu_seqlens_q"),
    )
    context = attention.core_attention(
        query,
        key,
        value,
        qkv_format=attention.qkv_format,
        softcap=attention.softcap if softcap is None else softcap,
        **kwargs,
    )
    # (output, bias) when return_bias, as TE's forward returns them
    return attention.proj(context, is_first_microbatch=is_first_microbatch)


@functools.cache
def te_transformer_layer_class():
    """te.TransformerLayer whose self-attention splits packed QKV with `PackedQKVSplit` or fuses the
    Q/K/V split with RoPE, and whose MLP fuses bias and GELU into its GEMMs.

    Same constructor, modules and parameter names as te.TransformerLayer; only the classes of
    `self_attention` and `self_attention.core_attention` change (to subclasses that add no state).
    """
    import transformer_engine.pytorch as te

    attention_class = te_dot_product_attention_class()
    multihead_class = te_multihead_attention_class()

    class TransformerLayer(te.TransformerLayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if type(self.self_attention) is te.MultiheadAttention:
                self.self_attention.__class__ = multihead_class
            core_attention = self.self_attention.core_attention
            if type(core_attention) is te.DotProductAttention:
                core_attention.__class__ = attention_class
            # Read by LayerNormMLP.forward (TE's switch for the separate bias+GELU kernel).
            self.layernorm_mlp.bias_gelu_nvfusion = False

    return TransformerLayer
