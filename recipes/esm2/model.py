"""ESM-2 (Lin et al. 2023), as fair-esm and Hugging Face's EsmForMaskedLM compute it, over packed sequences.

Token embedding with ESM's token dropout (the embeddings of <mask> tokens are zeroed, and each sequence's
rescaled by (1 - 0.15 x 0.8) / (1 - its share of <mask> tokens)); pre-LayerNorm blocks (self-attention over
each sequence with rotary positions, a GELU MLP, biases everywhere); a final LayerNorm; the LM head: dense,
GELU, LayerNorm, then the embedding matrix (tied) plus a bias.

The input is rows of packed sequences (recipes/esm2/packing.py): tokens [rows, budget] and cu_seqlens
[rows, slots + 1]; the blocks see all rows as one packed stream ("thd"): TE's fused attention with
cu_seqlens on GPUs, the plain-torch twin's masked attention elsewhere (same parameter names). With sequences
padded to a multiple (seqlens: their real lengths) the padding is left out of every real token's attention; with
context parallelism (distributed.cp) each rank holds its share of every sequence (core/layers/context_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.config.errors import ConfigError
from core.layers.context_parallel import packed_load_balanced_positions
from core.layers.namespace import Layers
from core.layers.torch_twins import packed_positions
from recipes.esm2.tokenizer import MASK, PAD, VOCABULARY

VOCAB_SIZE = len(VOCABULARY)
# The embedding table and the LM head's bias hold 64 rows, not 33: tensors of 33 rows leave the GEMMs and the
# gradient buffers after them misaligned (slow fallback kernels). Rows past the vocabulary are never looked up,
# and their logits are cut off.
TABLE_ROWS = 64
MASK_RATIO_TRAIN = 0.15 * 0.8  # ESM-2's token dropout assumes this share of <mask> tokens in training


class LMHead(nn.Module):
    def __init__(self, hidden: int, eps: float, activation, layers: Layers, device):
        super().__init__()
        self.dense = layers.Linear(hidden, hidden, bias=True, device=device)
        self.norm = layers.LayerNorm(hidden, eps=eps, device=device)
        self.bias = nn.Parameter(torch.zeros(TABLE_ROWS, device=device))
        self.activation = activation

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.activation(self.dense(x)))
        return F.linear(x, embedding.to(x.dtype), self.bias.to(x.dtype))[..., :VOCAB_SIZE].contiguous()


class ESM2(nn.Module):
    def __init__(self, cfg, layers: Layers, device: torch.device | str = "cpu", lm_head: bool = True):
        """lm_head=False: the backbone alone (a task model's: recipes/esm2_finetune), which gives hidden states."""
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.activation == "gelu_erf" and layers.name == "te":
            raise ConfigError(
                "model.activation=gelu_erf (the exact GELU) has no TransformerEngine kernel: use "
                "model.activation=gelu (TE's tanh form) with model.backend=te, or model.backend=torch"
            )
        if layers.tp.size > 1:
            raise ConfigError(f"distributed.tp={layers.tp.size}: the ESM-2 recipe has no tensor parallelism; use tp=1")
        self.cfg, self.high_precision, self.max_seq_length = cfg, layers.high_precision, cfg.max_seq_length
        self.cp = layers.cp
        self.token_cross_entropy = layers.token_cross_entropy
        self.embedding = nn.Embedding(TABLE_ROWS, h, device=device)
        self.rotary = layers.RotaryPositionEmbedding(h // heads, rotary_base=cfg.rotary_base).to(device)
        self.layers = nn.ModuleList(
            layers.TransformerLayer(
                hidden_size=h,
                ffn_hidden_size=cfg.ffn_hidden_size,
                num_attention_heads=heads,
                layernorm_epsilon=cfg.norm_epsilon,
                hidden_dropout=cfg.hidden_dropout,
                attention_dropout=cfg.attention_dropout,
                self_attn_mask_type="padding",
                attn_input_format="thd",
                fuse_qkv_params=cfg.fuse_qkv_params,
                bias=True,
                activation=cfg.activation,
                normalization="LayerNorm",
                layer_number=i + 1,
                device=device,
            )
            for i in range(cfg.num_layers)
        )
        self.final_norm = layers.LayerNorm(h, eps=cfg.norm_epsilon, device=device)
        if lm_head:
            gelu = (lambda x: F.gelu(x)) if cfg.activation == "gelu_erf" else (lambda x: F.gelu(x, approximate="tanh"))
            self.lm_head = LMHead(h, cfg.norm_epsilon, gelu, layers, device)

    def forward(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor | None = None,
        hidden_layer: int | None = None,
        seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [rows, budget], cu_seqlens [rows, slots + 1] -> logits [rows, budget, vocab]; with `labels`
        [rows, budget], each token's cross-entropy instead (fp32; labels < 0 count 0); with `hidden_layer`, the
        hidden states [rows, budget, hidden] after that many blocks (0: the embeddings; num_layers: after the
        final LayerNorm). `seqlens` [rows, slots]: the real tokens of each slot where cu_seqlens are offsets of
        padded sequences. With context parallelism tokens and labels are [rows, budget / cp], this rank's share."""
        rows, width = tokens.shape
        cu = flat_offsets(cu_seqlens, width * self.cp.size)  # the whole stream's (padded) offsets
        offsets = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        if seqlens is not None:  # TE's layout of padded sequences: real lengths, and the padded offsets
            real = torch.cat([cu.new_zeros(1), seqlens.reshape(-1).cumsum(0).to(cu.dtype)])
            padded = dict(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, pad_between_seqs=True)
            offsets = dict(cu_seqlens_q=real, cu_seqlens_kv=real, **padded)
        x = self.embed(tokens.reshape(-1), cu, seqlens)
        angles = self.rotary(self.max_seq_length).to(x.device)
        if hidden_layer == 0:
            return x.view(rows, width, -1)
        for i, block in enumerate(self.layers):
            x = block(
                x,
                rotary_pos_emb=angles,
                self_attn_mask_type="padding",
                max_seqlen_q=self.max_seq_length,
                max_seqlen_kv=self.max_seq_length,
                **offsets,
            )
            if hidden_layer == i + 1 and hidden_layer < len(self.layers):
                return x.view(rows, width, -1)
        x = self.final_norm(x)
        if hidden_layer is not None:
            return x.view(rows, width, -1)
        with self.high_precision():  # the vocabulary projection stays out of FP8 (33 columns, and sensitive)
            logits = self.lm_head(x, self.embedding.weight)
        if labels is None:
            return logits.view(rows, width, -1)
        flat_labels = labels.reshape(-1)
        # A tensor of its own, not a view: FSDP2 hooks its backward on the module's output.
        # (where, not a product: whatever the kernels leave in padding rows must not reach the sum as 0 x NaN)
        loss = torch.where(flat_labels >= 0, self.token_cross_entropy(logits, flat_labels.clamp(min=0)), 0.0)
        return loss.view(rows, width).clone()

    def embed(
        self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token embeddings [tokens, hidden] with ESM-2's token dropout per sequence (its share of <mask> tokens
        over its real tokens, over every context-parallel rank's share); padding zeroed."""
        x = self.embedding(tokens)
        is_mask = tokens == MASK
        if self.cfg.token_dropout:
            x = x.masked_fill(is_mask[:, None], 0.0)
            cp = self.cp
            sequence, _ = packed_positions(cu_seqlens, tokens.shape[0] * cp.size)
            if cp.size > 1:  # the sequences of this rank's tokens
                sequence = sequence[packed_load_balanced_positions(cu_seqlens, cp.size, cp.rank)]
            slots = cu_seqlens.shape[0]  # one more than the sequences: tokens past the last offset (none here)
            masked = torch.zeros(slots, device=x.device).index_add_(0, sequence, is_mask.float())
            if seqlens is not None:
                length = torch.cat([seqlens.reshape(-1).float(), seqlens.new_zeros(1, dtype=torch.float)])
            else:
                length = torch.zeros(slots, device=x.device).index_add_(
                    0, sequence, torch.ones_like(is_mask, dtype=torch.float)
                )
            if cp.size > 1:
                dist.all_reduce(masked, group=cp.group)
                if seqlens is None:
                    dist.all_reduce(length, group=cp.group)
            scale = (1 - MASK_RATIO_TRAIN) / (1 - masked / length.clamp(min=1))
            x = x * scale[sequence, None].to(x.dtype)
        return x * (tokens != PAD)[:, None].to(x.dtype)


def flat_offsets(cu_seqlens: torch.Tensor, budget: int) -> torch.Tensor:
    """Per-row offsets [rows, slots + 1] -> the offsets of all rows as one stream [rows x slots + 1] (int32)."""
    rows = cu_seqlens.shape[0]
    shifted = (
        cu_seqlens[:, :-1] + budget * torch.arange(rows, device=cu_seqlens.device, dtype=cu_seqlens.dtype)[:, None]
    )
    end = torch.full((1,), rows * budget, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.cat([shifted.reshape(-1), end]).to(torch.int32)
