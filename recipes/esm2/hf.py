"""ESM-2 weights to and from Hugging Face's EsmForMaskedLM (the layout of the facebook/esm2_* checkpoints).

Our names are TE's (recipes/esm2/model.py); the Q, K and V projections are one weight whose rows are grouped
per head as [q, k, v] (TE's interleaved layout), where Hugging Face keeps three. The LM head's decoder is the
embedding matrix in both (tied). The contact-prediction head of EsmForMaskedLM is not ours: it is left out.
"""

from __future__ import annotations

from typing import Any

import torch

from recipes.esm2.model import TABLE_ROWS, VOCAB_SIZE
from recipes.esm2.tokenizer import CLS, EOS, MASK, PAD

HF_PREFIX = "esm."


def _renames(num_layers: int) -> dict[str, str]:
    """Our name -> Hugging Face's, for every tensor that maps one to one."""
    names = {"embedding.weight": "esm.embeddings.word_embeddings.weight",
             "final_norm.weight": "esm.encoder.emb_layer_norm_after.weight",
             "final_norm.bias": "esm.encoder.emb_layer_norm_after.bias",
             "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
             "lm_head.norm.weight": "lm_head.layer_norm.weight", "lm_head.norm.bias": "lm_head.layer_norm.bias",
             "lm_head.bias": "lm_head.bias"}
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"esm.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            names[f"{ours}self_attention.layernorm_qkv.layer_norm_{kind}"] = f"{theirs}attention.LayerNorm.{kind}"
            names[f"{ours}self_attention.proj.{kind}"] = f"{theirs}attention.output.dense.{kind}"
            names[f"{ours}layernorm_mlp.layer_norm_{kind}"] = f"{theirs}LayerNorm.{kind}"
            names[f"{ours}layernorm_mlp.fc1_{kind}"] = f"{theirs}intermediate.dense.{kind}"
            names[f"{ours}layernorm_mlp.fc2_{kind}"] = f"{theirs}output.dense.{kind}"
    return names


def to_hf(weights: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """Our model's state dict (TE's `_extra_state` entries ignored) -> EsmForMaskedLM's."""
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    out = {theirs: weights[ours] for ours, theirs in _renames(m.num_layers).items()}
    for name in ("esm.embeddings.word_embeddings.weight", "lm_head.bias"):  # our tables' padding rows left out
        out[name] = out[name][:VOCAB_SIZE]
    out["lm_head.decoder.weight"] = out["esm.embeddings.word_embeddings.weight"]  # tied: HF expects both names
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.self_attention.layernorm_qkv.", f"esm.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            if m.fuse_qkv_params:
                packed = weights[ours + kind]
                per_head = packed.reshape(heads, 3, head_dim, *packed.shape[1:])
                q, k, v = (per_head[:, j].reshape(heads * head_dim, *packed.shape[1:]) for j in range(3))
            else:
                q, k, v = (weights[f"{ours}{part}_{kind}"] for part in ("query", "key", "value"))
            out[theirs + f"query.{kind}"], out[theirs + f"key.{kind}"], out[theirs + f"value.{kind}"] = q, k, v
    inv_freq = 1.0 / m.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    out["esm.rotary_embeddings.inv_freq"] = inv_freq
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], m: Any) -> dict[str, torch.Tensor]:
    """EsmForMaskedLM's state dict -> ours (the contact head and the rotary buffer dropped; checked: every tensor
    we need is there, with our shapes)."""
    heads, head_dim, h = m.num_attention_heads, m.hidden_size // m.num_attention_heads, m.hidden_size
    names = _renames(m.num_layers)
    missing = [theirs for theirs in names.values() if theirs not in hf]
    if missing:
        raise ValueError(f"not an ESM-2 EsmForMaskedLM of {m.num_layers} layers: {len(missing)} tensors missing, "
                         f"e.g. {missing[:3]}")
    out = {ours: hf[theirs] for ours, theirs in names.items()}
    for name in ("embedding.weight", "lm_head.bias"):
        if out[name].shape[0] != VOCAB_SIZE:
            raise ValueError(f"{names[name]}: {out[name].shape[0]} rows, ESM-2's vocabulary has {VOCAB_SIZE}")
        padding = out[name].new_zeros(TABLE_ROWS - VOCAB_SIZE, *out[name].shape[1:])
        out[name] = torch.cat([out[name], padding])  # rows our model never reads
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.self_attention.layernorm_qkv.", f"esm.encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{theirs}{part}.{kind}"] for part in ("query", "key", "value"))
            if m.fuse_qkv_params:
                stacked = torch.stack([t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)], dim=1)
                out[ours + kind] = stacked.reshape(3 * h, *q.shape[1:])
            else:
                out[f"{ours}query_{kind}"], out[f"{ours}key_{kind}"], out[f"{ours}value_{kind}"] = q, k, v
    expected = {"embedding.weight": (TABLE_ROWS, h), "lm_head.bias": (TABLE_ROWS,),
                "layers.0.layernorm_mlp.fc1_weight": (m.ffn_hidden_size, h)}
    for name, shape in expected.items():
        if tuple(out[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(out[name].shape)} in the Hugging Face weights, the config gives "
                             f"{shape}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(m: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the EsmForMaskedLM our model `m` (the model config) equals."""
    return {"architectures": ["EsmForMaskedLM"], "model_type": "esm", "vocab_size": VOCAB_SIZE,
            "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "intermediate_size": m.ffn_hidden_size,
            "hidden_act": "gelu", "hidden_dropout_prob": m.hidden_dropout,
            "attention_probs_dropout_prob": m.attention_dropout, "max_position_embeddings": m.max_seq_length + 2,
            "initializer_range": m.init_std, "layer_norm_eps": m.norm_epsilon, "position_embedding_type": "rotary",
            "rope_theta": m.rotary_base, "use_cache": True, "emb_layer_norm_before": False,
            "token_dropout": m.token_dropout, "is_folding_model": False, "tie_word_embeddings": True,
            "pad_token_id": PAD, "mask_token_id": MASK, "cls_token_id": CLS, "eos_token_id": EOS, "dtype": dtype}
