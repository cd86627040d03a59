"""Samples/s of a recipe's training input pipeline (decode + augment + collate) per DataLoader worker
count, on this machine's CPUs, without a model: size `data.num_workers` with it.

    python benchmarks/input_pipeline.py --config vit_sanity --workers 0 1 2 4
    python benchmarks/input_pipeline.py --config vit_base_patch16_224 data=imagefolder data.root=/data/imagenet \
        data.num_classes=1000 --workers 4 8 16 --batches 50
    # JPEGs decoded and augmented on the GPU (nvJPEG), the loader workers only read files:
    python benchmarks/input_pipeline.py --config vit_base_patch16_224 data=imagefolder data.root=/data/imagenet \
        data.num_classes=1000 data.decode_on=device --device cuda --workers 2 4 8

Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(dataset, batch_size: int, workers: int, batches: int, warmup: int, collate, finish=None) -> float:
    import torch

    from core.data.loading import make_loader
    from core.data.sampling import GlobalBatchSampler

    loader = make_loader(dataset, GlobalBatchSampler(batch_size, batch_size, 1, 0), workers, False, 0, collate)
    it = iter(loader)
    finish, out = finish or (lambda batch: batch), None
    for _ in range(warmup):  # worker start-up and first files out of the timing
        finish(next(it))
    start = time.perf_counter()
    for _ in range(batches):
        out = finish(next(it))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    del out
    seconds = time.perf_counter() - start
    del it, loader
    return batches * batch_size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="vit_sanity")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's micro-batch size")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--device",
        default=None,
        help="also move each batch to this device the way the loop does (with data.decode_on=device: "
        "decode and augment there), e.g. cuda",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the config")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from core.config.validation import validate
    from core.data.datasets import MultiEpochDatasetResampler
    from core.distributed import launch
    from core.runtime import request_cuda_connections
    from recipes.registry import get_recipe, register_configs

    register_configs()
    launch.register_resolvers()

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = validate(compose(config_name=args.config, overrides=args.overrides + ["checkpoint.path=unused"]))
    recipe = get_recipe(cfg.recipe)(cfg)
    request_cuda_connections(recipe.cuda_connections())  # as a run does, before CUDA starts
    train_set = recipe.build_datasets().train
    batch_size = args.batch_size or cfg.training.micro_batch_size
    needed = (max(args.workers) + 1) * (args.batches + args.warmup + 8) * batch_size
    stream = MultiEpochDatasetResampler(train_set, num_samples=needed, seed=cfg.seed)
    rows = []
    print(f"{args.config}: {len(train_set)} training samples, batch {batch_size}, {os.cpu_count()} CPUs")
    print(f"{'workers':>8} {'samples/s':>12}")
    for workers in args.workers:
        finish = None
        if args.device:
            import torch

            device = torch.device(args.device)
            finish = lambda batch: recipe.to_device(batch, device)  # noqa: E731
        rate = measure(stream, batch_size, workers, args.batches, args.warmup, recipe.collate_fn(), finish)
        rows.append({"workers": workers, "samples_per_sec": rate})
        print(f"{workers:>8} {rate:>12,.0f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) / f"input_pipeline-{args.config}-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "config": args.config,
                "overrides": args.overrides,
                "batch_size": batch_size,
                "device": args.device,
                "cpus": os.cpu_count(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
