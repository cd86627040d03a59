"""The GPT recipe's LoRA (finetune.mode=lora) to and from PEFT LoRA adapters of a LlamaForCausalLM.

    ours (layers.i.self_attention.)        PEFT (base_model.model.model.layers.i.self_attn.)
    layernorm_qkv.lora_A [r, h]            q_proj / k_proj / v_proj .lora_A: the same A for each
    layernorm_qkv.lora_B [qkv rows, r]     q_proj / k_proj / v_proj .lora_B: B's rows split as the fused weight's rows
                                           (TE's per-KV-group layout, recipes/gpt/hf.py:_qkv_rows; with
                                           model.fuse_qkv_params=false: query, key, value concatenated)
    proj.lora_A / lora_B                   o_proj.lora_A / lora_B

The scale is alpha / r on both sides (finetune.lora.alpha = lora_alpha). Back (from-hf --base): q, k and v with one
A (what the export writes) become a fused LoRA of rank r; with different A's (PEFT trains them apart) the A's are
stacked, rank r per part present, and each part's B sits in its own block of columns, zeros elsewhere, so that B A is
exactly B_p A_p on part p's rows. Parts the adapter leaves out (q and v only is PEFT's Llama default) get zero rows;
o_proj is padded with zero rows of A and columns of B to that rank (one rank for every module). LoRA on the MLP or
the embeddings is refused: the MLP's GEMMs run inside one fused module where no LoRA reaches (core/layers/lora.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch

from core.checkpointing.hf_folders import PEFT_PREFIX, peft_lora_config
from recipes.gpt.hf import _heads, _qkv_rows

QKV = ("q", "k", "v")
OURS = re.compile(r"layers\.(\d+)\.self_attention\.(layernorm_qkv|proj)\.(lora_[AB])\.weight")
THEIRS = re.compile(re.escape(PEFT_PREFIX) + r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(lora_[AB])\.weight")


def split_qkv_rows(t: torch.Tensor, m: dict, fused: bool) -> dict[str, torch.Tensor]:
    """Rows of our QKV layout (fused: per KV group its query heads, key, value; else q, k, v) -> q, k, v."""
    heads, groups, head_dim = _heads(m)
    if not fused:
        return dict(zip(QKV, t.split([heads * head_dim, groups * head_dim, groups * head_dim])))
    blocks = _qkv_rows(m)
    parts: dict[str, list] = {p: [] for p in QKV}
    for (which, _, _), block in zip(blocks, t.split([rows for _, _, rows in blocks])):
        parts[which].append(block)
    return {p: torch.cat(parts[p]) for p in QKV}


def join_qkv_rows(parts: dict[str, torch.Tensor], m: dict, fused: bool) -> torch.Tensor:
    """split_qkv_rows' inverse."""
    if not fused:
        return torch.cat([parts[p] for p in QKV])
    _, groups, head_dim = _heads(m)
    pieces = {p: parts[p].split(parts[p].shape[0] // groups) for p in QKV}
    return torch.cat([pieces[p][g] for g in range(groups) for p in QKV])


def adapter_to_peft(weights: dict[str, torch.Tensor], m: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our LoRA matrices -> a PEFT adapter_model.safetensors' tensors (fp32) and its target_modules."""
    lora = {k: v for k, v in weights.items() if ".lora_A." in k or ".lora_B." in k}
    if not lora:
        raise ValueError("the run has no LoRA weights (finetune.mode is not lora): export it without --adapter")
    odd = [k for k in lora if OURS.fullmatch(k) is None]
    if odd:
        raise ValueError(
            f"{odd[0]}: a PEFT adapter of a Llama holds LoRA on layernorm_qkv and proj only; export the merged model "
            "(without --adapter); nothing was written"
        )
    fused = bool(m.get("fuse_qkv_params", True))
    out = {}
    for name, t in lora.items():
        layer, module, side = OURS.fullmatch(name).groups()
        theirs = f"{PEFT_PREFIX}model.layers.{layer}.self_attn."
        if module == "proj":
            out[f"{theirs}o_proj.{side}.weight"] = t
            continue
        parts = {p: t.clone() for p in QKV} if side == "lora_A" else split_qkv_rows(t, m, fused)
        out |= {f"{theirs}{p}_proj.{side}.weight": piece for p, piece in parts.items()}
    targets = sorted({name.rsplit(".", 3)[-3] for name in out})
    return {k: v.float().contiguous() for k, v in out.items()}, targets


def adapter_config(lora: dict[str, Any], targets: list[str], base: Optional[str]) -> dict[str, Any]:
    """adapter_config.json of adapter_to_peft's tensors (finetune.lora's rank, alpha and dropout)."""
    return peft_lora_config(lora, "CAUSAL_LM", targets, base)


def lora_from_peft(tensors: dict[str, torch.Tensor], r: int, m: dict, fused: bool, file: Path) -> tuple[dict, int]:
    """A PEFT Llama adapter's tensors -> our LoRA matrices (module docstring) and their rank. ValueError naming the
    file and tensor for a module we cannot map, a layer the base lacks, shapes that do not fit, LoRA on some layers
    only."""
    lora: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in tensors.items():
        found = THEIRS.fullmatch(name)
        if found is None:
            raise ValueError(
                f"{file}: {name}: LoRA on a module this recipe cannot map (it maps self_attn's q_proj, k_proj, "
                "v_proj and o_proj; the MLP runs fused inside one module); nothing was imported"
            )
        layer, part, side = int(found[1]), found[2], found[3]
        if layer >= m["num_layers"]:
            raise ValueError(f"{file}: {name}: the base model has {m['num_layers']} layers; nothing was imported")
        lora[(layer, part, side)] = t.float()
    per_layer: dict[int, set] = {}
    for layer, part, _ in lora:
        per_layer.setdefault(layer, set()).add(part)
    kinds = {frozenset(parts) for parts in per_layer.values()}
    if len(kinds) != 1 or len(per_layer) != m["num_layers"]:
        raise ValueError(
            f"{file}: LoRA on different modules in different layers ({len(per_layer)} of {m['num_layers']} layers "
            "hold any): finetune.lora.target_modules applies to every layer; nothing was imported"
        )
    kind = next(iter(kinds))
    _check_shapes(lora, r, m, file)
    parts = [p for p in QKV if p in kind]
    same_a = all(torch.equal(lora[(i, p, "lora_A")], lora[(i, parts[0], "lora_A")]) for i in per_layer for p in parts)
    rank = r if same_a or not parts else r * len(parts)
    out = {}
    for i in range(m["num_layers"]):
        ours = f"layers.{i}.self_attention."
        if parts:
            blocks = {p: torch.zeros(rows, rank) for p, rows in _rows(m).items() if p in QKV}
            for j, p in enumerate(parts):  # one A: B_p as it is; stacked A's: B_p in its own columns
                columns = slice(0, r) if same_a else slice(j * r, (j + 1) * r)
                blocks[p][:, columns] = lora[(i, p, "lora_B")]
            stacked = [lora[(i, p, "lora_A")] for p in (parts[:1] if same_a else parts)]
            out[ours + "layernorm_qkv.lora_A.weight"] = torch.cat(stacked)
            out[ours + "layernorm_qkv.lora_B.weight"] = join_qkv_rows(blocks, m, fused)
        if "o" in kind:
            a, b = lora[(i, "o", "lora_A")], lora[(i, "o", "lora_B")]
            out[ours + "proj.lora_A.weight"] = torch.cat([a, a.new_zeros(rank - r, a.shape[1])])
            out[ours + "proj.lora_B.weight"] = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], dim=1)
    return {k: v.contiguous() for k, v in out.items()}, rank


def _rows(m: dict) -> dict[str, int]:
    """Output rows of q_proj, k_proj, v_proj and o_proj."""
    heads, groups, head_dim = _heads(m)
    return {"q": heads * head_dim, "k": groups * head_dim, "v": groups * head_dim, "o": m["hidden_size"]}


def _check_shapes(lora: dict, r: int, m: dict, file: Path) -> None:
    rows, h = _rows(m), m["hidden_size"]
    for (layer, part, side), t in sorted(lora.items()):
        want = (r, h) if side == "lora_A" else (rows[part], r)
        if tuple(t.shape) != want:
            raise ValueError(
                f"{file}: layer {layer} {part}_proj {side} is {tuple(t.shape)}; r={r} and the base model make it "
                f"{want}; nothing was imported"
            )
    for layer, part, _ in sorted(lora):
        if {(layer, part, "lora_A"), (layer, part, "lora_B")} - set(lora):
            raise ValueError(f"{file}: layer {layer} {part}_proj: lora_A without lora_B or the reverse")
