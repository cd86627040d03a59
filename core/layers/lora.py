"""LoRA (Hu et al. 2021): a trainable low-rank update beside a frozen weight (finetune.mode=lora).

On a module M whose weight W is [out, in], `M.lora_A.weight` [r, in] and `M.lora_B.weight` [out, r] (B starts at
zero, so the model starts as the base); M's output gains scale * dropout(x) A^T B^T, scale = alpha / r, where x is
M's input (LayerNorm'd or RMSNorm'd first for a LayerNormLinear, with the module's own norm parameters). B's rows
follow W's rows: TE's fused QKV weight's per-head interleaved rows, or with fuse_qkv_params=false the query, key and
value weights concatenated in that order. The update is added by a forward hook on M, so TE modules and their torch
twins (core/layers/torch_twins.py) take it alike and keep their own parameter names; the LoRA matmuls run outside
FP8 (plain torch ops on the hook's side).

`merge_lora_weights` folds the pairs of a state dict into the weights (export to Hugging Face, merged = unmerged).
"""

from __future__ import annotations

from typing import Any

import torch

LORA_A, LORA_B = "lora_A", "lora_B"
# Weight names of an unfused LayerNormLinear QKV (fuse_qkv_params=false), in the order of B's row blocks.
SPLIT_WEIGHTS = ("query_weight", "key_weight", "value_weight")
# Module names whose weight lives inside a fused kernel that an output hook cannot reach (LayerNormMLP's fc1, fc2).
FUSED_INSIDE = {"fc1": "layernorm_mlp", "fc2": "layernorm_mlp", "fc1_weight": "layernorm_mlp"}


def merge_lora_weights(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`weights` with every `X.lora_A.weight` / `X.lora_B.weight` pair folded into X's weight (X.weight, or
    X.query_weight / X.key_weight / X.value_weight, B's rows split in that order): W + scale * B @ A, computed in
    fp32 and stored in W's dtype; the LoRA entries are dropped. `scale` = alpha / rank. ValueError naming the module
    for a half pair, a module without a weight, or shapes that do not fit."""
    out = {k: v for k, v in weights.items() if f".{LORA_A}." not in k and f".{LORA_B}." not in k}
    modules = sorted({k.rsplit(f".{LORA_A}.", 1)[0] for k in weights if k.endswith(f".{LORA_A}.weight")})
    orphans = [k for k in weights if k.endswith(f".{LORA_B}.weight") and k.rsplit(f".{LORA_B}.", 1)[0] not in modules]
    if orphans:
        raise ValueError(f"LoRA: {orphans[0]} has no {LORA_A} beside it")
    for module in modules:
        a_name, b_name = f"{module}.{LORA_A}.weight", f"{module}.{LORA_B}.weight"
        if b_name not in weights:
            raise ValueError(f"LoRA: {a_name} has no {b_name} beside it")
        a, b = weights[a_name].float(), weights[b_name].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA of {module}: A {tuple(a.shape)} and B {tuple(b.shape)} are not [r, in] and [out, r]"
            )
        delta = scale * (b @ a)
        targets = _weight_names(weights, module)
        rows = [weights[n].shape[0] for n in targets]
        if sum(rows) != delta.shape[0] or any(weights[n].shape[1:] != delta.shape[1:] for n in targets):
            shapes = [tuple(weights[n].shape) for n in targets]
            raise ValueError(f"LoRA of {module}: B @ A is {tuple(delta.shape)}, the weights {targets} are {shapes}")
        for name, part in zip(targets, delta.split(rows)):
            out[name] = (weights[name].float() + part).to(weights[name].dtype)
    return out


def _weight_names(weights: dict[str, Any], module: str) -> list[str]:
    if f"{module}.weight" in weights:
        return [f"{module}.weight"]
    split = [f"{module}.{n}" for n in SPLIT_WEIGHTS]
    if all(n in weights for n in split):
        return split
    raise ValueError(f"LoRA of {module}: no {module}.weight (nor {module}.query_weight/key_weight/value_weight)")
