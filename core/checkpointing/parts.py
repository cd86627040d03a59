"""The stateful parts of a checkpoint. The loop hands the manager a mapping {key: part} (`training_parts`); each
part says what it saves, what it loads into (given what the checkpoint holds under its key) and how it takes the
loaded state back. Adding state to checkpoints is adding a part: save and restore do not change.

    parts = {"model": ModelPart(parallel), "optim": OptimizerPart(parallel, optimizer),
             "scheduler": StatefulPart(scheduler), "train_state": TrainStatePart(state), ...}
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from core.checkpointing.fp8 import FP8_TENSORS, fp8_states, set_fp8_states
from core.checkpointing.layout import CheckpointError, empty_like_saved, saved_weights
from core.checkpointing.rng import RNG_KEYS, rng_state, set_rng_state
from core.checkpointing.weights import check_weights_fit
from core.config.errors import ConfigError
from core.training import optim

log = logging.getLogger("checkpoint")


class Saved:
    """What a checkpoint holds under one part's key: its DCP keys without the `<key>.` prefix."""

    def __init__(self, path: Path, metadata: Metadata, key: str):
        self.path, self.metadata, self.prefix = Path(path), metadata, key + "."
        self.keys = [k[len(self.prefix) :] for k in metadata.state_dict_metadata if k.startswith(self.prefix)]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def top_level(self) -> set[str]:
        return {k.split(".", 1)[0] for k in self.keys}

    def empty(self, key: str) -> torch.Tensor:
        """A tensor of the saved shape and dtype under `key` (relative to the part), for DCP to fill."""
        return empty_like_saved(self.metadata, self.prefix + key)


class CheckpointPart(Protocol):
    def state_dict(self) -> dict:
        """What to save now (tensors, sharded DTensors, plain values); empty: nothing to save."""

    def load_target(self, saved: Saved) -> Optional[dict]:
        """The state dict DCP should fill in place from `saved`; None: nothing to load for this part."""

    def load_state_dict(self, state: dict) -> None:
        """Take the loaded state (the filled target)."""


class ModelPart:
    """The (sharded) model weights by canonical name; a checkpoint that does not fit is an error."""

    def __init__(self, parallel):
        self.parallel = parallel

    def state_dict(self) -> dict:
        return self.parallel.model_state_dict()

    def load_target(self, saved: Saved) -> dict:
        model = self.parallel.model_state_dict()
        check_weights_fit(str(saved.path), model, saved_weights(saved.metadata))
        return model

    def load_state_dict(self, state: dict) -> None:
        self.parallel.load_model_state_dict(state)


class OptimizerPart:
    """The optimizer state keyed by parameter name; a checkpoint without it starts the optimizer fresh."""

    def __init__(self, parallel, optimizer: torch.optim.Optimizer, is_main: bool):
        self.parallel, self.optimizer, self.is_main = parallel, optimizer, is_main

    def state_dict(self) -> dict:
        return self.parallel.optimizer_state_dict(self.optimizer)

    def load_target(self, saved: Saved) -> Optional[dict]:
        if not saved:
            if self.is_main:
                log.warning("%s has no optimizer state: the optimizer starts fresh", saved.path)
            return None
        groups: dict[int, set[str]] = {}
        for key in saved.keys:  # param_groups.<index>.<setting>
            kind, index, *setting = key.split(".", 2)
            if kind == "param_groups" and index.isdigit() and setting:
                groups.setdefault(int(index), set()).add(setting[0])
        mismatch = optim.groups_mismatch(groups, self.optimizer.param_groups)
        if mismatch:
            raise ConfigError(
                f"{saved.path}: {mismatch}. The parameter groups follow {', '.join(optim.GROUP_KEYS)}: resume with "
                "the checkpoint's values of those (checkpoint.allow_config_changes=true does not lift this), or start "
                f"a new run from its weights with a fresh optimizer: checkpoint.init_from={saved.path}"
            )
        return self.parallel.optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        self.parallel.load_optimizer_state_dict(self.optimizer, state)


class StatefulPart:
    """Anything with state_dict() / load_state_dict() (e.g. the LR scheduler), loaded when saved. The loaded state
    must have the shape of the object's own (load_state_dict methods such as LambdaLR's copy it into the
    object's attributes: a value of another type would replace one of them)."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_target(self, saved: Saved) -> Optional[dict]:
        return self.obj.state_dict() if saved else None

    def load_state_dict(self, state: dict) -> None:
        check_like(state, self.obj.state_dict(), type(self.obj).__name__)
        self.obj.load_state_dict(state)


def check_like(loaded: Any, own: Any, where: str) -> None:
    """ValueError naming the place unless `loaded` has the structure and value types of `own` (a whole number
    may stand for a float)."""
    if isinstance(own, dict):
        if not isinstance(loaded, dict) or set(loaded) - set(own):
            raise ValueError(
                f"{where}: {type(loaded).__name__} with keys {sorted(map(str, loaded))[:8]}, expected "
                f"the keys {sorted(map(str, own))[:8]}"
                if isinstance(loaded, dict)
                else f"{where}: a {type(loaded).__name__}, expected a dict"
            )
        for key, value in loaded.items():
            check_like(value, own[key], f"{where}.{key}")
    elif isinstance(own, (list, tuple)):
        if type(loaded) is not type(own) or len(loaded) != len(own):
            raise ValueError(f"{where}: {loaded!r:.80}, expected a {type(own).__name__} of {len(own)}")
        for i, (value, mine) in enumerate(zip(loaded, own)):
            check_like(value, mine, f"{where}[{i}]")
    elif torch.is_tensor(own):
        if not torch.is_tensor(loaded) or loaded.dtype != own.dtype:
            raise ValueError(f"{where}: expected a {own.dtype} tensor")
    elif not (type(loaded) is type(own) or (type(own) is float and type(loaded) is int)):
        raise ValueError(f"{where}={loaded!r:.80}: expected a {type(own).__name__}")


class TrainStatePart(StatefulPart):
    """The loop's counters (core/training/state.py); a counter the checkpoint lacks keeps its default."""

    def load_target(self, saved: Saved) -> Optional[dict]:
        present = saved.top_level()
        return {k: v for k, v in self.obj.state_dict().items() if k in present} or None


class RNGPart:
    """Each rank's RNG states under rank_<r>; resumed on more ranks than saved, the others keep their seed."""

    def __init__(self, rank: int, world_size: int, device: torch.device, is_main: bool):
        self.rank, self.world_size, self.device, self.is_main = rank, world_size, device, is_main

    def state_dict(self) -> dict:
        return {f"rank_{self.rank}": rng_state(self.device)}

    def load_target(self, saved: Saved) -> Optional[dict]:
        if len(saved.top_level()) < self.world_size and self.is_main:
            log.warning(
                "the checkpoint has no RNG state for some ranks (saved on fewer ranks): they keep their seeded state"
            )
        mine = f"rank_{self.rank}."
        # Only the states set_rng_state takes are read: a key of another name gets no tensor (none is allocated).
        target = {
            k[len(mine) :]: saved.empty(k) for k in saved.keys if k.startswith(mine) and k[len(mine) :] in RNG_KEYS
        }
        return {f"rank_{self.rank}": target} if target else None

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state[f"rank_{self.rank}"], self.device)  # dropout etc. continue as uninterrupted


class FP8Part:
    """TransformerEngine's FP8 scaling state per module (core/checkpointing/fp8.py)."""

    def __init__(self, model: nn.Module, fp8_recipe: Any):
        self.model, self.fp8_recipe = model, fp8_recipe

    def state_dict(self) -> dict:
        return fp8_states(self.model)

    def load_target(self, saved: Saved) -> Optional[dict]:
        if not saved:
            return None
        if self.fp8_recipe is None:
            log.warning("%s holds FP8 scaling state, but this run does not use TE FP8: not loaded", saved.path)
            return None
        modules = dict(self.model.named_modules())
        target: dict[str, dict[str, torch.Tensor]] = {}
        for key in saved.keys:
            module, _, tensor = key.rpartition(".")
            if tensor not in (*FP8_TENSORS, "settings") or not isinstance(
                getattr(modules.get(module), "fp8_meta", None), dict
            ):
                raise CheckpointError(
                    f"{saved.path}: fp8.{key} is not FP8 state of a TransformerEngine module of this model"
                )
            target.setdefault(module, {})[tensor] = saved.empty(key)
        return target

    def load_state_dict(self, state: dict) -> None:
        set_fp8_states(self.model, state, self.fp8_recipe)


def training_parts(
    parallel, optimizer: torch.optim.Optimizer, scheduler: Any, state: Any, env: Any, fp8_recipe: Any
) -> dict[str, CheckpointPart]:
    """What a training checkpoint holds, by top-level key: the (sharded) model, the optimizer, the learning-rate
    schedule, the loop's counters (core/training/state.py), each rank's RNG states and TE's FP8 scaling state.
    `env`: the run's ranks and device (core/distributed/env.py)."""
    return {
        "model": ModelPart(parallel),
        "optim": OptimizerPart(parallel, optimizer, env.is_main),
        "scheduler": StatefulPart(scheduler),
        "train_state": TrainStatePart(state),
        "rng": RNGPart(env.rank, env.world_size, env.device, env.is_main),
        "fp8": FP8Part(parallel.model, fp8_recipe),
    }
