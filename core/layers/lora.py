"""LoRA (Hu et al. 2021): a trainable low-rank update beside a frozen weight (finetune.mode=lora).

On a module M whose weight W is [out, in], `M.lora_A.weight` [r, in] and `M.lora_B.weight` [out, r] (B starts at
zero, so the model starts as the base); M's output gains scale * dropout(x) A^T B^T, scale = alpha / r, where x is
M's input (for a LayerNormLinear: the normalized input M computes anyway, which M is asked to return beside its output
through `return_layernorm_output`; the hook hands M's caller the output alone). B's rows follow W's rows: TE's fused
QKV weight's per-head interleaved rows, or with fuse_qkv_params=false the query, key and value weights concatenated in
that order. The update is added by a forward hook on M, so TE modules and their torch twins
(core/layers/torch_twins.py) take it alike and keep their own parameter names; the LoRA matmuls run outside FP8
(plain torch ops on the hook's side), in M's output dtype, the second one adding into M's output in its epilogue.

`merge_lora_weights` folds the pairs of a state dict into the weights (export to Hugging Face, merged = unmerged).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from core.config.errors import ConfigError

LORA_A, LORA_B = "lora_A", "lora_B"
# Weight names of an unfused LayerNormLinear QKV (fuse_qkv_params=false), in the order of B's row blocks.
SPLIT_WEIGHTS = ("query_weight", "key_weight", "value_weight")
# LayerNormMLP's two GEMMs run inside the one fused module (TE's and its twin's): no output hook reaches them.
FUSED_INSIDE = ("fc1", "fc2")


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
        targets = _weight_names(weights, module)
        rows = [weights[n].shape[0] for n in targets]
        product = (b.shape[0], a.shape[1])  # checked before it is computed: small A and B can make a huge B @ A
        if sum(rows) != product[0] or any(tuple(weights[n].shape[1:]) != product[1:] for n in targets):
            shapes = [tuple(weights[n].shape) for n in targets]
            raise ValueError(f"LoRA of {module}: B @ A is {product}, the weights {targets} are {shapes}")
        delta = scale * (b @ a)
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


# The module kinds LoRA can sit on (TE's classes and their torch twins share these names).
LINEAR_KINDS = ("Linear", "LayerNormLinear")


def add_lora(
    model: nn.Module,
    target_modules: list[str],
    rank: int,
    alpha: float,
    dropout: float,
    seed: int,
    exclude: tuple[str, ...] = (),
    key: str = "finetune.lora.target_modules",
) -> list[str]:
    """LoRA on every module of `model` whose name's last part is in `target_modules` (modules under an `exclude`
    prefix left out: the task head trains whole). Returns the modules' names. ConfigError naming `key` for a target
    that names no module LoRA can take, with the names it could take."""
    candidates = {
        name: m
        for name, m in model.named_modules()
        if name and not any(name == p or name.startswith(p + ".") for p in exclude)
    }
    takes = {name: m for name, m in candidates.items() if _kind(m) is not None}
    chosen = []
    for target in dict.fromkeys(target_modules):
        matched = [name for name in takes if name.rsplit(".", 1)[-1] == target]
        if not matched:
            raise ConfigError(_unmatched(key, target, candidates, takes))
        chosen += matched
    for name in sorted(set(chosen), key=chosen.index):
        attach(takes[name], name, rank, alpha, dropout, seed)
    return sorted(set(chosen), key=chosen.index)


def _unmatched(key: str, target: str, candidates: dict[str, nn.Module], takes: dict[str, nn.Module]) -> str:
    could = sorted({name.rsplit(".", 1)[-1] for name in takes}) or ["nothing: the model has no Linear layers"]
    named = [n for n in candidates if n.rsplit(".", 1)[-1] == target]
    mlps = [n for n, m in candidates.items() if type(m).__name__ == "LayerNormMLP"]
    if target in FUSED_INSIDE or (named and named[0] in mlps):
        why = (
            f"{target!r}: LayerNormMLP's fc1 and fc2 run inside one fused module ({(named or mlps or ['?'])[0]}), "
            "where no forward hook reaches them"
        )
    elif named:
        why = f"{named[0]} is a {type(candidates[named[0]]).__name__}, not a Linear or LayerNormLinear layer"
    else:
        why = f"no module of the model is named {target!r}"
    return f"{key}: {why}; LoRA can target {', '.join(could)}"


def _kind(module: nn.Module) -> Optional[str]:
    """'Linear' or 'LayerNormLinear' for a module LoRA can take (by class name: TE's and the twins' alike; a
    torch nn.Linear too), else None. A LayerNormLinear must be able to return its normalized input."""
    if isinstance(module, nn.Linear):
        return "Linear"
    name = type(module).__name__
    if name == "LayerNormLinear" and not hasattr(module, "return_layernorm_output"):
        return None
    return name if name in LINEAR_KINDS and _base_weights(module) else None


def _base_weights(module: nn.Module) -> list[torch.Tensor]:
    """The module's weight matrices, in the order their rows make its output (one `weight`, or a split's parts)."""
    own = dict(module.named_parameters(recurse=False))
    if "weight" in own:
        return [own["weight"]]
    return [p for n, p in own.items() if n.endswith("weight") and not n.startswith("layer_norm") and p.dim() == 2]


def attach(module: nn.Module, name: str, rank: int, alpha: float, dropout: float, seed: int) -> None:
    """Give `module` (named `name` in its model) `lora_A` [rank, in] (PEFT's kaiming-uniform init, drawn from
    `seed` and `name`: the same on every rank and layer backend) and `lora_B` [out, rank] (zeros), and the forward
    hook that adds their update to its output."""
    weights = _base_weights(module)
    out_features, in_features = sum(w.shape[0] for w in weights), weights[0].shape[1]
    device = weights[0].device
    module.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=torch.float32)
    module.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear draw it
    with torch.no_grad():
        module.lora_A.weight.copy_(torch.rand(rank, in_features, generator=generator) * 2 * bound - bound)
        module.lora_B.weight.zero_()
    takes_normalized, hands_back_normalized = False, False
    if _kind(module) == "LayerNormLinear":
        # M returns (output, ..., normalized input): the hook reads the last element, and drops it again unless
        # M's caller asked for it too.
        takes_normalized, hands_back_normalized = True, bool(module.return_layernorm_output)
        module.return_layernorm_output = True
    hook = _LoraHook(alpha / rank, dropout, takes_normalized, hands_back_normalized)
    module.register_forward_hook(hook, with_kwargs=True)


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


class _LoraHook:
    """The forward hook: output + scale * dropout(x) A^T B^T, onto the first element of a tuple output (TE's
    return_bias gives (output, bias)); for a LayerNormLinear x is the normalized input, the tuple's last element."""

    def __init__(self, scale: float, dropout: float, takes_normalized: bool, hands_back_normalized: bool):
        self.scale, self.dropout = scale, dropout
        self.takes_normalized, self.hands_back_normalized = takes_normalized, hands_back_normalized

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.takes_normalized:
            x = output[-1]
            rest = output[1:] if self.hands_back_normalized else output[1:-1]
            out = self.add_update(module, output[0], x)
            return (out, *rest) if rest else out
        x = args[0] if args else next(iter(kwargs.values()))
        if isinstance(output, tuple):
            return (self.add_update(module, output[0], x), *output[1:])
        return self.add_update(module, output, x)

    def add_update(self, module: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + scale * dropout(x) A^T B^T in out's dtype: the second matmul adds into out (one addmm)."""
        dtype = out.dtype
        x = F.dropout(x.to(dtype), self.dropout, module.training)
        down = F.linear(x, _local(module.lora_A.weight).to(dtype))
        flat = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            down.reshape(-1, down.shape[-1]),
            _local(module.lora_B.weight).to(dtype).t(),
            alpha=self.scale,
        )
        return flat.view(out.shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
