"""A process's random number generator states as plain tensors, so a resumed run draws what the
interrupted one would have drawn (dropout, augmentation outside the datasets)."""

from __future__ import annotations

import random

import numpy as np
import torch

# The states rng_state saves (cuda on a GPU only); a resume reads these and nothing else of a rank's.
RNG_KEYS = ("python", "python_gauss", "numpy", "numpy_gauss", "torch", "cuda")


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's python, numpy, torch (and CUDA) RNG states as tensors."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys.astype(np.int64), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    python = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    random.setstate((python[0], tuple(python[1:]), None if gauss != gauss else gauss))
    numpy = state["numpy"].tolist()
    np.random.set_state(
        ("MT19937", np.array(numpy[:-2], dtype=np.uint32), numpy[-2], numpy[-1], float(state["numpy_gauss"][0]))
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
