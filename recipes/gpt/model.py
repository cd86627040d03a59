"""A decoder-only GPT: token embedding, rotary positions, pre-norm blocks (RMSNorm, causal self-attention
with grouped-query attention, SwiGLU MLP), final RMSNorm, output projection (or the tied embedding).

Blocks are `layers.TransformerLayer` (TE's on GPUs, the plain-torch twin elsewhere: same parameter names).
With distributed.tp > 1 the blocks are tensor-parallel (each rank holds a block of the KV groups with their
query heads, and of the MLP's hidden units); the embedding, final norm and output projection stay whole
on every rank (replicated over the tensor-parallel ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from core.config.errors import ConfigError
from core.layers.namespace import Layers
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

    def forward(self, tokens: torch.Tensor, kv_cache=None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]; with `labels` [batch, seq], the cross-entropy of each
        label instead (fp32), without keeping the logits. With a `kv_cache` (from `new_kv_cache`, its `pre_step`
        called for these tokens) the tokens continue the cached sequences."""
        logits = self._logits(tokens, kv_cache)
        if labels is None:
            return logits
        # A tensor of its own (one float per token), not a view of the flat losses: FSDP2 hooks its backward on
        # the module's output and warns that a view could lose the hook.
        return self.token_cross_entropy(logits, labels).clone()

    def _logits(self, tokens: torch.Tensor, kv_cache) -> torch.Tensor:
        x = self.embedding(tokens)
        if kv_cache is None:
            angles, cached = self.rotary(tokens.shape[1]).to(x.device), {}
        else:  # the layers pick the new tokens' positions from the cache
            angles = self.rotary(kv_cache.max_sequence_length).to(x.device)
            cached = dict(inference_params=kv_cache, self_attn_mask_type="padding_causal")
        for block in self.layers:
            x = block(x, rotary_pos_emb=angles, **cached)
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
