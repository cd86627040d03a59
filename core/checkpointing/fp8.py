"""TransformerEngine's delayed-scaling FP8 state (scales and amax histories) as plain tensors.

TE keeps it in each module's `_extra_state`, a pickle, which Megatron-FSDP's state dict drops; the
checkpoint stores the tensors (and the module's plain settings as JSON bytes) instead, for every backend.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch
from torch import nn

FP8_TENSORS = {
    "scale_fwd": ("scaling_fwd", "scale"),
    "amax_history_fwd": ("scaling_fwd", "amax_history"),
    "scale_bwd": ("scaling_bwd", "scale"),
    "amax_history_bwd": ("scaling_bwd", "amax_history"),
}


def fp8_states(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """TransformerEngine modules' delayed-scaling FP8 state (what their `_extra_state` holds), as tensors."""
    out = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict) or getattr(meta.get("scaling_bwd"), "amax_history", None) is None:
            continue
        out[name] = {
            key: getattr(meta[group], attr).detach().cpu().clone() for key, (group, attr) in FP8_TENSORS.items()
        }
        # TE also keeps the module's plain settings (num_gemms, ...); JSON keeps them data, not code.
        plain = {
            k: (["__tuple__", list(v)] if isinstance(v, tuple) else v)
            for k, v in meta.items()
            if k != "buffer_index_and_autocast_key" and _is_plain(v)
        }
        out[name]["settings"] = torch.frombuffer(bytearray(json.dumps(plain).encode()), dtype=torch.uint8)
    return out


def _is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, (bool, int, float, str)) for v in value)
    return isinstance(value, (bool, int, float, str))


def _settings(blob: torch.Tensor, meta: dict) -> dict:
    """The saved plain settings, as TE restores them into the module's `meta`, except any that would replace a
    setting of another type there (e.g. the recipe object with a string): the file restores plain values, as
    the save took them (ValueError if the bytes are not a JSON object)."""
    plain = json.loads(blob.numpy().tobytes().decode())
    if not isinstance(plain, dict):
        raise ValueError(f"FP8 settings are a JSON {type(plain).__name__}, expected an object")
    restored = {k: (tuple(v[1]) if isinstance(v, list) and v[:1] == ["__tuple__"] else v) for k, v in plain.items()}
    return {
        k: v
        for k, v in restored.items()
        if k != "buffer_index_and_autocast_key"
        and _is_plain(v)
        and (k not in meta or (_is_plain(meta[k]) and type(v) is type(meta[k])))
    }


def set_fp8_states(model: nn.Module, saved: dict[str, dict[str, torch.Tensor]], fp8_recipe: Any) -> None:
    """Restore FP8 scales and amax histories through TE's own `set_extra_state`.

    TE takes that state only as a pickle and, rightly, refuses pickles from files unless told to trust
    them. Ours is built here from plain tensors and the run's own FP8 recipe, never read from the file,
    so it is safe to let TE load it."""
    modules = dict(model.named_modules())
    previous = os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"
    try:
        for name, tensors in saved.items():
            tensors = dict(tensors)
            settings = _settings(tensors.pop("settings"), modules[name].fp8_meta) if "settings" in tensors else {}
            payload = pickle.dumps({"recipe": fp8_recipe, **tensors, "extra_fp8_variables": settings})
            modules[name].set_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        torch.cuda.synchronize()  # TE copies the tensors asynchronously
    finally:
        if previous is None:
            os.environ.pop("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
        else:
            os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = previous
