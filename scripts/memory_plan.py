"""A config's memory plan per GPU for N GPUs of a given size, on any machine (nothing is built; the same plan a GPU run
prints before its first step: core/training/memory_plan.py). Exit status 1 when it does not fit, naming settings that
would; 2, with one line naming the key or option, for a config or an argument it cannot use (as train.py).

    python scripts/memory_plan.py --config-name gpt_1b --gpus 8 --gpu-memory-gib 80 model=llama3_8b \\
        training.micro_batch_size=1 distributed.mfsdp.zero_dp_strategy=3
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python scripts/memory_plan.py` from anywhere
    sys.path.insert(0, str(REPO))


def _gpus(text: str) -> int:
    """--gpus: a world size, 1 or more (0 or a negative count would plan a mesh no run can have)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of GPUs (1 or more), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of GPUs (1 or more), got {text}")
    return value


def _gib(text: str) -> float:
    """--gpu-memory-gib: a finite size above 0 (NaN would compare as "does not fit", inf as "fits", whatever the
    plan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in GiB above 0 (e.g. 80), got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a size in GiB above 0 (e.g. 80), got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", required=True)
    p.add_argument(
        "--gpus", type=_gpus, default=1, help="GPUs of the run: the world size, dp_outer x dp_shard x cp x tp"
    )
    p.add_argument("--gpu-memory-gib", type=_gib, default=80.0)
    p.add_argument("overrides", nargs="*", help="key=value, as train.py takes them")
    return p


def _config(config_name: str, overrides: list[str]):
    """The validated config, as train.py composes it: an unknown key, another recipe's model or data option, a value
    Hydra or the schemas refuse all raise ConfigError naming it (train.py's one line, not a traceback)."""
    from hydra import compose, initialize_config_dir

    from core.config import command_line
    from core.config.errors import ConfigError
    from core.config.overrides import check_overrides
    from core.config.validation import validate
    from recipes.registry import config_keys

    argv = ["--config-name", config_name, *overrides]
    groups = {p.name for p in (REPO / "configs").iterdir() if p.is_dir()}
    check_overrides(overrides, config_keys(argv), groups)
    command_line.check_group_choices(argv)
    # No run: the checkpoint folder (named from Hydra's run) only needs to be a string here.
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return validate(compose(config_name=config_name, overrides=["checkpoint.path=memory-plan", *overrides]))
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors get train.py's one line; others propagate
        line = command_line.composition_error(e)
        if line is None:
            raise
        raise ConfigError(line) from None


def main(argv: Optional[list[str]] = None) -> int:
    from core.config.errors import ConfigError
    from core.distributed import launch
    from recipes.registry import register_configs

    args = _parser().parse_args(argv)
    register_configs()
    launch.register_resolvers()
    try:
        return _plan(args, _config(args.config_name, args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace, cfg) -> int:
    """Print the plan of `cfg` for args.gpus GPUs of args.gpu_memory_gib; 1 when it does not fit."""
    from core.config.errors import ConfigError
    from core.distributed.env import mesh_shape
    from core.runtime import Machine, resolve_parallel_backend
    from core.training import memory_plan as mp
    from recipes.registry import get_recipe

    recipe = get_recipe(cfg.recipe)(cfg)
    d = cfg.distributed
    outer, shard, cp, tp = mesh_shape(args.gpus, int(d.dp_outer), int(d.dp_shard), int(d.tp), int(d.cp))
    backend = str(resolve_parallel_backend(d.backend, Machine(cuda=True, te=True)))
    capacity = args.gpu_memory_gib * mp.GIB
    result = mp.plan_for_run(cfg, recipe, shard, outer * shard, tp, backend, capacity, cp=cp)
    if result is None:
        print(f"{args.config_name}: no memory plan (recipe {cfg.recipe} gives no block shape)")
        return 0
    plan, suggestions = result
    print("\n".join(plan.lines(capacity)))
    try:
        line = mp.check(plan, capacity, suggestions, "refuse")
    except ConfigError as e:
        print(f"does not fit: {e}")
        return 1
    print(line or "fits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
