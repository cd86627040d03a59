"""A decoder-only GPT: token embedding, rotary positions, pre-norm blocks (RMSNorm, causal self-attention
with grouped-query attention, SwiGLU MLP), final RMSNorm, output projection (or the tied embedding).

Blocks are `layers.TransformerLayer` (TE's on GPUs, the plain-torch twin elsewhere: same parameter names).
With distributed.tp > 1 the blocks are tensor-parallel (each rank holds a block of the KV groups with their
query heads, and of the MLP's hidden units); the embedding, final norm and output projection stay whole
on every rank (replicated over the tensor-parallel ranks).

Packed rows (data.packing: recipes/gpt/packing.py): with `cu_seqlens` [rows, slots + 1] the rows run as one packed
stream of documents (TE's "thd" layout, as ESM-2's packed sequences): causal attention within each document only
("padding_causal"), rotary positions restarting at each document's first token; with context parallelism each
rank holds its share of every document. The same blocks run both layouts:
each forward sets the layout its input has (`_use_layout`), so a model trained on packed rows generates and
predicts on plain ones.
"""

from __future__ import annotations

import torch
from torch import nn

from core.config.errors import ConfigError
from core.layers.namespace import Layers
from recipes.esm2.model import flat_offsets
from recipes.gpt.config import GPTModelConfig


class GPT(nn.Module):
    def __init__(self, cfg: GPTModelConfig, vocab_size: int, layers: Layers, device: torch.device | str = "cpu"):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        groups = cfg.num_query_groups or heads
        if h % heads or heads % groups:
            raise ValueError(
                f"hidden_size={h}, num_attention_heads={heads}, num_query_groups={groups}: the hidden "
                "size must divide into the heads and the heads into the groups"
            )
        tp = layers.tp.size
        for what, n in (
            ("num_attention_heads", heads),
            ("num_query_groups", groups),
            ("ffn_hidden_size", cfg.ffn_hidden_size),
        ):
            if n % tp:
                raise ConfigError(f"model.{what}={n} is not divisible by distributed.tp={tp}")
        self.cfg, self.vocab_size = cfg, vocab_size
        self.high_precision = layers.high_precision  # the logits stay out of FP8: see forward
        self.token_cross_entropy = layers.token_cross_entropy  # fused (TE) or plain torch
        self.kv_cache_class, self.kv_heads, self.head_dim = layers.InferenceParams, groups // tp, h // heads
        self.cp = layers.cp  # distributed.cp: each row holds this rank's share of a longer sequence
        self.embedding = nn.Embedding(vocab_size, h, device=device)
        self.rotary = layers.RotaryPositionEmbedding(h // heads, rotary_base=cfg.rotary_base).to(device)
        self.layers = nn.ModuleList(
            layers.TransformerLayer(
                hidden_size=h,
                ffn_hidden_size=cfg.ffn_hidden_size,
                num_attention_heads=heads,
                num_gqa_groups=groups,
                layernorm_epsilon=cfg.norm_epsilon,
                hidden_dropout=cfg.hidden_dropout,
                attention_dropout=cfg.attention_dropout,
                self_attn_mask_type="causal",
                attn_input_format="bshd",
                fuse_qkv_params=cfg.fuse_qkv_params,
                bias=False,
                activation="swiglu",
                normalization="RMSNorm",
                layer_number=i + 1,
                device=device,
                **layers.tp.layer_kwargs(),  # tensor parallelism: attention heads and MLP split over ranks
            )
            for i in range(cfg.num_layers)
        )
        self.final_norm = layers.RMSNorm(h, eps=cfg.norm_epsilon, device=device)
        self.output_layer = None if cfg.tie_embeddings else layers.Linear(h, vocab_size, bias=False, device=device)

    def forward(
        self,
        tokens: torch.Tensor,
        kv_cache=None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]; with `labels` [batch, seq], the cross-entropy of each
        label instead (fp32), without keeping the logits. With a `kv_cache` (from `new_kv_cache`, its `pre_step`
        called for these tokens) the tokens continue the cached sequences. With `cu_seqlens` [batch, slots + 1]
        (each row's document offsets: recipes/gpt/packing.py) attention stays within each document and its
        positions restart."""
        if cu_seqlens is None:
            x = self._blocks(tokens, kv_cache)
        elif kv_cache is not None:
            raise ValueError("packed rows (cu_seqlens) take no KV cache")
        else:
            x = self._packed_blocks(tokens, cu_seqlens).view(*tokens.shape, -1)
        logits = self._head(x)
        if labels is None:
            return logits
        # A tensor of its own (one float per token), not a view of the flat losses: FSDP2 hooks its backward on
        # the module's output and warns that a view could lose the hook.
        return self.token_cross_entropy(logits, labels).clone()

    def _blocks(self, tokens: torch.Tensor, kv_cache) -> torch.Tensor:
        """tokens [batch, seq] -> the final norm's input [batch, seq, hidden] (causal over each row)."""
        x = self.embedding(tokens)
        if kv_cache is None:  # the whole row's angles: with context parallelism the layers pick this rank's positions
            angles, cached = self.rotary(tokens.shape[1] * self.cp.size).to(x.device), {}
        elif self.cp.size > 1:
            raise ValueError("a KV cache with context parallelism (distributed.cp > 1)")
        else:  # the layers pick the new tokens' positions from the cache
            angles = self.rotary(kv_cache.max_sequence_length).to(x.device)
            cached = dict(inference_params=kv_cache, self_attn_mask_type="padding_causal")
        for block in self.layers:
            _use_layout(block, "bshd")
            x = block(x, rotary_pos_emb=angles, **cached)
        return x

    def _packed_blocks(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """tokens [rows, seq], cu_seqlens [rows, slots + 1] -> [rows x seq, hidden]: all rows as one stream. With
        context parallelism tokens are this rank's share of each document (seq = the row's tokens / cp) and
        cu_seqlens the whole rows' offsets, as TE's context-parallel attention takes them."""
        rows, width = tokens.shape
        seq = width * self.cp.size
        if cu_seqlens.dim() != 2 or cu_seqlens.shape[0] != rows:
            raise ValueError(
                f"cu_seqlens of shape {tuple(cu_seqlens.shape)} for {rows} rows: expected [rows, slots + 1]"
            )
        cu = flat_offsets(cu_seqlens, seq)
        x = self.embedding(tokens.reshape(-1))
        # A document is at most a row: the positions and the kernels' bound both stop at seq_length.
        longest = max(seq, self.cfg.seq_length)
        angles = self.rotary(longest).to(x.device)
        for block in self.layers:
            _use_layout(block, "thd")
            x = block(
                x,
                rotary_pos_emb=angles,
                self_attn_mask_type="padding_causal",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            )
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(x)
        # The logits stay out of FP8: the vocabulary GEMM is the most sensitive one.
        with self.high_precision():
            if self.output_layer is None:
                return torch.nn.functional.linear(x, self.embedding.weight.to(x.dtype))
            return self.output_layer(x)

    def new_kv_cache(self, batch_size: int, max_length: int, dtype: torch.dtype):
        """An empty key/value cache for `batch_size` sequences of up to `max_length` tokens (TE's
        InferenceParams, or the twin's): generation then feeds each new token alone."""
        return self.kv_cache_class(
            max_batch_size=batch_size,
            max_sequence_length=max_length,
            num_heads_kv=self.kv_heads,
            head_dim_k=self.head_dim,
            dtype=dtype,
        )


def _use_layout(block: nn.Module, layout: str) -> None:
    """Run `block` (TE's TransformerLayer or the twin) on inputs of `layout`: "bshd" [batch, seq, hidden] or "thd"
    [tokens, hidden] with cu_seqlens. Both read the layout from these attributes at each forward, and it is set
    before every forward (never restored after), so a recomputation in the backward sees the forward's."""
    attention = block.self_attention
    attention.qkv_format = layout
    core_attention = getattr(attention, "core_attention", None)  # TE's DotProductAttention (the twin has none)
    if core_attention is not None:
        core_attention.qkv_format = layout
