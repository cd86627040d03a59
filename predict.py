"""Run a trained model over one data split and write one row per sample.

    torchrun --nproc-per-node N predict.py --config-name mnist_predict checkpoint.init_from=<step dir | .pt | .safetensors>
    python predict.py --config-name mnist_predict checkpoint.init_from=...          # one process

Top to bottom:
  1. config      - the recipe's config (model and data as in training) + `predict.*`
  2. distributed - the same process group, device and mesh as train.py
  3. model       - built and sharded like in training; weights from checkpoint.init_from, strictly
  4. data        - the split's samples dealt out over ranks; short shares padded, padding dropped
  5. predict     - the recipe's per-sample columns, gathered on rank 0, written as CSV in sample order
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from checkpoint import CheckpointError, load_weights
from core import config as config_lib
from core import distributed, launch, parallel, precision
from core import layers as layers_lib
from core.data import EvalBatchSampler, PaddedEval, make_loader, to_device
from recipes import get_recipe

log = logging.getLogger("predict")

config_lib.register_configs()
launch.register_resolvers()


@dataclass
class PredictResult:
    output: Path  # the CSV file (written by rank 0)
    rows: int
    metrics: dict = field(default_factory=dict)


@hydra.main(version_base="1.3", config_path="configs", config_name=None)
def main(cfg: DictConfig) -> None:
    try:
        predict(cfg, Path(HydraConfig.get().runtime.output_dir))
    except config_lib.ConfigError as e:
        log.error("config error: %s", e)
        raise SystemExit(2) from None
    except CheckpointError as e:
        log.error("checkpoint error: %s", e)
        raise SystemExit(3) from None


def predict(cfg: DictConfig, run_dir: Path) -> PredictResult:
    # 1. Config: the same strict check as training.
    cfg = config_lib.validate(cfg)
    if not cfg.checkpoint.init_from:
        raise config_lib.ConfigError("predict.py needs checkpoint.init_from=<step folder | file.pt | file.safetensors>")
    if cfg.predict.micro_batch_size < 1:
        raise config_lib.ConfigError(f"predict.micro_batch_size={cfg.predict.micro_batch_size}: expected >= 1")

    # 2. Distributed.
    d = cfg.distributed
    env = distributed.setup(d.dp_outer, d.dp_shard, d.tp, d.timeout_minutes)
    try:
        return _predict(cfg, env, run_dir)
    finally:
        distributed.teardown()


def _predict(cfg: DictConfig, env: distributed.DistEnv, run_dir: Path) -> PredictResult:
    recipe = get_recipe(cfg.recipe)(cfg)
    dist_backend = parallel.resolve_backend(cfg.distributed.backend, env.device)
    layer_backend = layers_lib.resolve_backend(cfg.model.backend, env.device)
    autocast = precision.autocast_factory(cfg.precision, env.device, layer_backend, amax_group=env.dp_group)
    output = Path(cfg.predict.output) if cfg.predict.output else run_dir / "predictions.csv"
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "resolved_config.yaml")

    # 3. Model: built, sharded and loaded as in training (any checkpoint layout, any world size).
    layers = layers_lib.get_layers(layer_backend, env.tensor_parallel())
    model = recipe.build_model(layers, env.device)
    par = parallel.shard(model, dist_backend, env, cfg.distributed, recipe.unit_modules(layers),
                         cfg.precision.param_dtype)
    load_weights(par, cfg.checkpoint.init_from, list(cfg.checkpoint.init_skip_prefixes),
                 cfg.checkpoint.init_ignore_unexpected, env.is_main)

    # 4. Data: rank r takes samples r, r + dp, ...; every rank runs the same number of batches (the
    #    sharded model's collectives need that), shorter shares padded with samples marked invalid.
    dataset = recipe.split(cfg.predict.split)
    loader = make_loader(PaddedEval(dataset),
                         EvalBatchSampler(len(dataset), cfg.predict.micro_batch_size, env.dp_size, env.dp_rank),
                         cfg.data.num_workers, env.device.type == "cuda" and cfg.data.pin_memory, cfg.seed,
                         recipe.collate_fn())
    if env.is_main:
        log.info("predicting %d %s samples with %s on %d ranks (%s, %s layers)", len(dataset), cfg.predict.split,
                 cfg.checkpoint.init_from, env.world_size, dist_backend, layer_backend)

    # 5. Predict: keep the valid rows of every batch, on the CPU.
    module = par.module
    module.eval()
    parts: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for batch in loader:
            valid = batch.pop("valid").bool()
            batch = to_device(batch, env.device)
            with autocast():
                columns = recipe.predict(module, batch)
            parts.append({k: v.detach().cpu()[valid] for k, v in columns.items()})
    local = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
    if env.mesh["tp"].get_local_rank() != 0:
        local = {}  # tensor-parallel peers computed the same rows
    gathered = [None] * env.world_size if env.is_main else None
    dist.gather_object(local, gathered, dst=0)
    result = PredictResult(output, 0)
    if env.is_main:
        shares = [g for g in gathered if g]
        columns = {k: torch.cat([s[k] for s in shares]) for k in shares[0]}
        if "idx" in columns:
            order = torch.argsort(columns["idx"], stable=True)
            columns = {k: v[order] for k, v in columns.items()}
        rows = write_csv(output, columns)
        if rows != len(dataset):
            raise RuntimeError(f"wrote {rows} rows for {len(dataset)} samples")
        metrics = recipe.summarize_predictions(columns)
        (output.parent / "prediction_metrics.json").write_text(json.dumps({"rows": rows, **metrics}, indent=1))
        log.info("wrote %d rows to %s%s", rows, output,
                 "".join(f" | {k} {v:.4f}" for k, v in metrics.items()))
        result = PredictResult(output, rows, metrics)
    return result


def write_csv(path: Path, columns: dict[str, torch.Tensor]) -> int:
    """One row per sample; a [N, k] column becomes <name>_0 .. <name>_{k-1}. Returns the row count."""
    names, blocks = [], []
    for name, values in columns.items():
        if values.dim() == 1:
            names.append(name)
            blocks.append(values[:, None])
        else:
            values = values.reshape(len(values), -1)
            names += [f"{name}_{i}" for i in range(values.shape[1])]
            blocks.append(values)
    n = len(blocks[0]) if blocks else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for row in zip(*(block.tolist() for block in blocks)):
            writer.writerow([f"{x:.7g}" if isinstance(x, float) else x for values in row for x in values])
    tmp.replace(path)  # a reader never sees a half-written file
    return n


if __name__ == "__main__":
    launch.prepare_argv()
    main()
    launch.exit_process(0)
