"""Device facts the metrics need: the bf16 peak for MFU, and peak memory."""

from __future__ import annotations

import resource
from typing import Optional

import torch

# Dense bf16 tensor-core peak per GPU (FLOP/s), from the vendors' datasheets (SXM parts).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak, or None when unknown (CPU, unlisted GPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
