"""Run a trained model over one data split and write one row per sample (per document for the GPT).

    torchrun --nproc-per-node N predict.py --config-name mnist_predict \
        checkpoint.init_from=<step dir | .pt | .safetensors>
    python predict.py --config-name mnist_predict checkpoint.init_from=...          # one process
    torchrun --nproc-per-node N predict.py --config-name gpt_sanity checkpoint.init_from=... predict.split=val

The model settings (and the data preprocessing the model depends on, and finetune.mode with the LoRA adapters'
finetune.lora.*) come from the config.yaml of the checkpoint.init_from step folder
(core/checkpointing/saved_config.py); the data to predict on is the config's.

Top to bottom:
  1. setup    - the session and model of train.py (core/session.py); weights from checkpoint.init_from, strictly
  2. data     - the split's samples dealt out over ranks; short shares padded, padding dropped
  3. predict  - the recipe's per-sample columns, gathered on rank 0 in sample order, finished by the recipe
                (class names, windows summed into documents), written as CSV with the split's metrics
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from core import session
from core.checkpointing.output_files import write_atomically
from core.checkpointing.saved_config import adopt_saved_model
from core.checkpointing.weights import load_weights
from core.config.errors import ConfigError
from core.data.loading import make_loader
from core.data.sampling import EvalBatchSampler, PaddedEval
from core.distributed import launch
from recipes.base import PREDICTION
from recipes.registry import check_supports, config_keys, get_recipe, predict_configs, register_configs

log = logging.getLogger("predict")


@dataclass
class PredictResult:
    output: Path  # the CSV file (written by rank 0)
    rows: int
    metrics: dict = field(default_factory=dict)


@hydra.main(version_base="1.3", config_path="configs", config_name=None)
def main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    if launch.CHOSEN_CONFIG and launch.global_rank() == 0:  # the command line named no config
        log.info("%s", launch.CHOSEN_CONFIG)
    session.exit_on_error(predict, cfg, Path(hydra_config.runtime.output_dir), list(hydra_config.overrides.task))


def predict(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> PredictResult:
    """`overrides`: the command line's (Hydra's overrides.task); a model setting given there must be the
    one the checkpoint was trained with."""
    if not cfg.checkpoint.init_from:
        raise ConfigError("predict.py needs checkpoint.init_from=<step folder | file.pt | file.safetensors>")
    # Validation reads the schemas from Hydra's store. Registered again here (a no-op when there) for the processes
    # that never ran __main__: a job hydra-submitit-launcher starts (it unpickles main) and a caller from Python.
    register_configs()
    cfg = adopt_saved_model(cfg, overrides, get_recipe)
    check_supports(cfg, PREDICTION, "predict.py")
    cfg = without_context_parallelism(cfg)
    output = prediction_output(cfg.predict.output, run_dir)
    with session.start(cfg, run_dir, get_recipe) as sess:
        # 1. The model as in training (any checkpoint layout, any world size), then its weights.
        parallel, _ = session.build_model(sess, training=False)
        ckpt = sess.cfg.checkpoint
        load_weights(
            parallel,
            ckpt.init_from,
            list(ckpt.init_skip_prefixes),
            ckpt.init_ignore_unexpected,
            sess.is_main,
            ckpt.verify_checksums,
        )
        # 2. Data: rank r takes samples r, r + dp, ...; every rank runs the same number of batches (the
        #    sharded model's collectives need that), shorter shares padded with samples marked invalid.
        pred = sess.cfg.predict
        split = pred.split or sess.recipe.default_split()
        if sess.is_main and not pred.folder and not pred.split:
            log.info(
                "predict.split is not given: predicting on the %s split (the data's test split where it has one, "
                "else val)",
                split,
            )
        dataset = sess.recipe.unlabeled(pred.folder) if pred.folder else sess.recipe.split(split)
        sampler = EvalBatchSampler(len(dataset), sess.cfg.predict.micro_batch_size, sess.env.dp_size, sess.env.dp_rank)
        loader = make_loader(
            PaddedEval(dataset),
            sampler,
            sess.cfg.data.num_workers,
            sess.env.device.type == "cuda" and sess.cfg.data.pin_memory,
            sess.cfg.seed,
            sess.recipe.collate_fn(),
        )
        if sess.is_main:
            log.info(
                "predicting %d samples of %s with %s", len(dataset), pred.folder or f"the {split} split", ckpt.init_from
            )
        # 3. Predict, gather on rank 0, write.
        local = predict_rows(sess, parallel.wrapped, loader)
        return write_predictions(sess, local, output, dataset)


def prediction_output(given: Optional[str], run_dir: Path) -> Path:
    """The CSV file predict.output names (null: <run dir>/predictions.csv), refused before any work where it cannot be
    written: an existing folder, or a path under a file. Found only when writing, after every prediction was made,
    those lost the run's work in a traceback."""
    if not given:
        return run_dir / "predictions.csv"
    path = Path(given)
    if path.is_dir():
        raise ConfigError(f"predict.output={given} is a folder: give a file in it (e.g. {path / 'predictions.csv'})")
    above = next((parent for parent in path.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"predict.output={given}: {above} is a file, not a folder")
    return path


def without_context_parallelism(cfg: DictConfig) -> DictConfig:
    """Prediction runs whole samples on each rank: distributed.cp (a training layout, e.g. the trained config's)
    becomes 1, its ranks data-parallel ones."""
    if cfg.distributed.cp == 1:
        return cfg
    log.info("predict.py: distributed.cp=%s is a training layout; predicting with distributed.cp=1", cfg.distributed.cp)
    cfg = cfg.copy()
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        cfg.distributed.cp = 1
    return cfg


def predict_rows(sess: session.Session, model: torch.nn.Module, loader) -> dict[str, torch.Tensor]:
    """This rank's valid rows of the recipe's per-sample columns, on the CPU."""
    model.eval()
    parts: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for batch in loader:
            valid = batch.pop("valid").bool()
            batch = sess.recipe.to_device(batch, sess.env.device)
            with sess.autocast():
                columns = sess.recipe.predict(model, batch)
            parts.append({k: v.detach().cpu()[valid] for k, v in columns.items()})
    local = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
    return local if sess.env.tp_rank == 0 else {}  # tensor-parallel peers computed the same rows


def write_predictions(sess: session.Session, local: dict[str, torch.Tensor], output: Path, dataset) -> PredictResult:
    """Gather every rank's rows on rank 0, order them by "idx", write the CSV and the split's metrics."""
    gathered = [None] * sess.env.world_size if sess.is_main else None
    dist.gather_object(local, gathered, dst=0)
    if not sess.is_main:
        return PredictResult(output, 0)
    shares = [g for g in gathered if g]
    columns = {k: torch.cat([share[k] for share in shares]) for k in shares[0]}
    if "idx" in columns:
        order = torch.argsort(columns["idx"], stable=True)
        columns = {k: v[order] for k, v in columns.items()}
    gathered_rows = len(next(iter(columns.values())))
    if gathered_rows != len(dataset):
        raise RuntimeError(f"gathered {gathered_rows} rows for {len(dataset)} samples")
    columns = sess.recipe.finish_predictions(dataset, columns)
    rows = write_csv(output, columns)
    metrics = sess.recipe.summarize_predictions(columns)
    (output.parent / "prediction_metrics.json").write_text(json.dumps({"rows": rows, **metrics}, indent=1))
    shown = "".join(f" | {k} {v}" if isinstance(v, int) else f" | {k} {v:.4f}" for k, v in metrics.items())
    log.info("wrote %d rows to %s%s", rows, output, shown)
    return PredictResult(output, rows, metrics)


def write_csv(path: Path, columns: dict[str, torch.Tensor | list]) -> int:
    """One row per sample; a [N, k] column becomes <name>_0 .. <name>_{k-1}; a list column (e.g. class
    names) holds one value per row, or a list of k per row. Returns the row count."""
    names, blocks = [], []
    for name, values in columns.items():
        if isinstance(values, list):
            width = len(values[0]) if values and isinstance(values[0], (list, tuple)) else None
            names += [name] if width is None else [f"{name}_{i}" for i in range(width)]
            blocks.append([[v] for v in values] if width is None else [list(v) for v in values])
        elif values.dim() == 1:
            names.append(name)
            blocks.append(values[:, None])
        else:
            values = values.reshape(len(values), -1)
            names += [f"{name}_{i}" for i in range(values.shape[1])]
            blocks.append(values)
    n = len(blocks[0]) if blocks else 0
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:  # a file name that is not UTF-8 is written as its bytes, as the file system has it
        with open(tmp, "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
            writer = csv.writer(f)
            writer.writerow(names)
            for row in zip(*(block if isinstance(block, list) else block.tolist() for block in blocks)):
                writer.writerow([f"{x:.7g}" if isinstance(x, float) else x for values in row for x in values])

    write_atomically(path, write)  # a reader never sees a half-written file
    return n


if __name__ == "__main__":
    register_configs()  # the schemas, into Hydra's ConfigStore
    launch.run_hydra(main, config_keys, lambda argv: session.config_of_init_from(argv, predict_configs()))
