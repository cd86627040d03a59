"""ESM-2 with a task head: the backbone (recipes/esm2/model.py without its LM head) over packed sequences, then a
head per sequence (pooled through the packing boundaries) or per residue.

Heads, as Hugging Face's (so that `to-hf` maps them one to one):
  sequence tasks:  pooled -> dropout -> dense -> tanh -> dropout -> out_proj   (EsmClassificationHead)
  residue task:    hidden -> dropout -> out_proj                                (EsmForTokenClassification)
They are plain torch.nn layers run outside FP8 (layers.high_precision) on every layer backend.

Pooling is a per-row matrix product with each slot's token membership (cu_seqlens), not a scatter: static shapes,
no host synchronisation (it runs inside a CUDA graph) and the same sums in every run (no atomics).
"""

from __future__ import annotations

import torch
from torch import nn

from core.layers.namespace import Layers
from recipes.esm2.model import ESM2
from recipes.esm2.tokenizer import CLS, EOS, PAD
from recipes.esm2_finetune.config import SEQUENCE_TASKS, Pooling

# out_proj holds its K output rows padded to a multiple of this: a bias of K (2, 3, ...) elements would leave every
# gradient buffer after it misaligned (Megatron-FSDP lays the parameters out back to back), and TE's weight-gradient
# GEMMs into misaligned buffers fall back to slow kernels (docs/performance.md). The rows past K are never read.
OUT_ROWS_MULTIPLE = 64


def out_rows(outputs: int) -> int:
    """The rows out_proj holds for `outputs` outputs."""
    return -(-outputs // OUT_ROWS_MULTIPLE) * OUT_ROWS_MULTIPLE


class SequenceHead(nn.Module):
    def __init__(self, hidden: int, outputs: int, dropout: float, device):
        super().__init__()
        self.outputs = outputs
        self.dense = nn.Linear(hidden, hidden, device=device)
        self.out_proj = nn.Linear(hidden, out_rows(outputs), device=device)
        self.dropout = nn.Dropout(dropout)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.dense(self.dropout(pooled)))
        return self.out_proj(self.dropout(x))[..., : self.outputs]


class ResidueHead(nn.Module):
    def __init__(self, hidden: int, outputs: int, dropout: float, device):
        super().__init__()
        self.outputs = outputs
        self.out_proj = nn.Linear(hidden, out_rows(outputs), device=device)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(hidden))[..., : self.outputs]


class ESM2TaskModel(ESM2):
    """forward(tokens [rows, budget], cu_seqlens [rows, slots + 1]) -> logits: sequence tasks [rows, slots, K] (one per
    slot of cu_seqlens; slots without residues give the head's output of zeros), the residue task
    [rows, budget, K]."""

    def __init__(self, cfg, layers: Layers, device: torch.device | str = "cpu"):
        super().__init__(cfg, layers, device, lm_head=False)
        outputs, h = len(cfg.classes), cfg.hidden_size
        self.per_sequence = cfg.task in SEQUENCE_TASKS
        self.pool_cls = cfg.pooling == Pooling.cls
        head = SequenceHead if self.per_sequence else ResidueHead
        self.head = head(h, outputs, cfg.head_dropout, device)

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, hidden_layer: int | None = None) -> torch.Tensor:
        """hidden_layer: the hidden states [rows, budget, hidden] after that many blocks instead (as ESM2's)."""
        if hidden_layer is not None:
            return super().forward(tokens, cu_seqlens, hidden_layer=hidden_layer)
        hidden = super().forward(tokens, cu_seqlens, hidden_layer=len(self.layers))
        with self.high_precision():
            if self.per_sequence:
                hidden = pool(hidden, tokens, cu_seqlens, self.pool_cls).to(hidden.dtype)
            # A tensor of its own, not a view: FSDP2 hooks its backward on the module's output.
            return self.head(hidden).clone()


def slot_membership(tokens: torch.Tensor, cu_seqlens: torch.Tensor, cls: bool) -> torch.Tensor:
    """[rows, slots, budget] (fp32): 1 where a token is one the slot's sequence pools over (its residues, or its
    <cls> token), else 0."""
    budget = tokens.shape[1]
    position = torch.arange(budget, device=tokens.device)[None, None, :]
    inside = (position >= cu_seqlens[:, :-1, None]) & (position < cu_seqlens[:, 1:, None])
    pooled = (tokens == CLS) if cls else (tokens != CLS) & (tokens != EOS) & (tokens != PAD)
    return (inside & pooled[:, None, :]).float()


def pool(hidden: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor, cls: bool) -> torch.Tensor:
    """hidden [rows, budget, h] -> each slot's mean over its pooled tokens [rows, slots, h] (fp32; 0 for none)."""
    membership = slot_membership(tokens, cu_seqlens, cls)
    with torch.autocast(hidden.device.type, enabled=False):  # sums of up to max_seq_length states: in fp32
        sums = torch.bmm(membership, hidden.float())
    return sums / membership.sum(dim=2, keepdim=True).clamp(min=1)
