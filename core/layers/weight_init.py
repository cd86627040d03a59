"""Deterministic weight initialisation, independent of device, layer backend and rank.

Each parameter is drawn on the CPU from its own generator, seeded from (seed, parameter name), then
copied to wherever the parameter lives. So TE and plain-torch models built from the same seed hold the
same weights, every rank starts identical before sharding, and adding a module does not shift the
random numbers of the others. A tensor-parallel parameter is drawn whole (its TP=1 shape) and the rank
keeps its part, so the weights do not depend on the tensor-parallel size either.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Optional

import torch
from torch import nn

from core.layers.tensor_parallel import TensorParallel, full_shape, local_part, splits

# rule(name, cpu_tensor, generator) fills the tensor in place; return False to keep the module's own init.
InitRule = Callable[[str, torch.Tensor, torch.Generator], Optional[bool]]


def param_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, rule: InitRule, tp: TensorParallel = TensorParallel()) -> None:
    split = splits(model) if tp.size > 1 else {}
    for name, param in model.named_parameters():
        if param.is_meta:  # a model built for its shapes alone (core/training/memory_plan.py) holds no values
            continue
        values = torch.empty(full_shape(param.shape, split.get(name), tp.size), dtype=torch.float32)
        if rule(name, values, param_generator(seed, name)) is False:
            continue
        param.copy_(local_part(values, split.get(name), tp.rank, tp.size).to(param.dtype))


def standard_rule(std: float, zero_init: tuple[str, ...] = ()) -> InitRule:
    """Truncated normal(0, std) at +-2 std for matrices, zeros for biases, ones for norm weights.

    Norm weights are recognised as 1-d parameters whose name ends in "weight"; names ending in one of
    `zero_init` start at zero.
    """

    def rule(name: str, t: torch.Tensor, g: torch.Generator) -> None:
        if zero_init and name.endswith(zero_init):
            t.zero_()
        elif t.dim() >= 2:
            nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std, generator=g)
        elif name.endswith("weight"):
            t.fill_(1.0)
        else:
            t.zero_()

    return rule


def linear_default_rule(model: nn.Module) -> InitRule:
    """torch.nn.Linear's own default, drawn per name: weight and bias uniform in +-1/sqrt(fan_in)
    (kaiming_uniform with a=sqrt(5) for the weight). Suits small MLPs; a bias takes the fan-in of the
    `weight` beside it."""
    fan_in = {
        name[: -len("weight")]: p.shape[1]
        for name, p in model.named_parameters()
        if p.dim() == 2 and name.endswith("weight")
    }

    def rule(name: str, t: torch.Tensor, g: torch.Generator) -> None:
        prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
        if prefix not in fan_in:
            raise ValueError(f"linear_default_rule: {name} is not the weight or bias of a linear layer")
        bound = 1.0 / math.sqrt(fan_in[prefix])
        t.uniform_(-bound, bound, generator=g)

    return rule
