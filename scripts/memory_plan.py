"""A config's memory plan per GPU for N GPUs of a given size, on any machine (nothing is built; the same plan a GPU run
prints before its first step: core/training/memory_plan.py). Exit status 1 when it does not fit, naming settings that
would.

    python scripts/memory_plan.py --config-name gpt_1b --gpus 8 --gpu-memory-gib 80 model=llama3_8b \\
        training.micro_batch_size=1 distributed.mfsdp.zero_dp_strategy=3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python scripts/memory_plan.py` from anywhere
    sys.path.insert(0, str(REPO))


def main(argv: Optional[list[str]] = None) -> int:
    from hydra import compose, initialize_config_dir

    from core.config.errors import ConfigError
    from core.config.validation import validate
    from core.distributed import launch
    from core.distributed.env import mesh_shape
    from core.runtime import Machine, resolve_parallel_backend
    from core.training import memory_plan as mp
    from recipes.registry import get_recipe, register_configs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", required=True)
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the run: the world size, dp_outer x dp_shard x cp x tp")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("overrides", nargs="*", help="key=value, as train.py takes them")
    args = p.parse_args(argv)
    register_configs()
    launch.register_resolvers()
    # No run: the checkpoint folder (named from Hydra's run) only needs to be a string here.
    overrides = ["checkpoint.path=memory-plan", *args.overrides]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = validate(compose(config_name=args.config_name, overrides=overrides))
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
