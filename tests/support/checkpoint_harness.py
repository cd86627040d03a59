"""Test-side tools for checkpoint tests: train in several phases inside one worker process, with optional
instrumentation (a signal sent at a given step, the sample indices each rank trained on)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

# A tiny ViT on 48 synthetic images: global batch 16 = 2 ranks x micro-batch 4 x 2 accumulation steps
# (or 1 rank x 4 x 4), so one epoch is 3 steps; warmup ends at step 5.
TINY = [
    "data=synthetic", "data.synthetic_train_size=48", "data.synthetic_val_size=8", "data.num_classes=10",
    "data.num_workers=0", "model.backend=torch", "precision=fp32", "model.hidden_size=32", "model.depth=2",
    "model.num_heads=2", "training.steps=8", "training.global_batch_size=16", "training.micro_batch_size=4",
    "training.log_every_n_steps=1", "training.val_every_n_steps=0", "training.val_at_end=false", "optim.lr=3e-3",
    "optim.weight_decay=0.1", "optim.eps=1e-5", "scheduler.warmup_steps=5", "logger.progress_bar=never",
]


def phase(tmp, name: str, ckpt: str, extra: list[str] = (), **kw) -> dict:
    """One run_phases entry: TINY + extra overrides, checkpoints in <tmp>/<ckpt>, run dir <tmp>/<name>."""
    return {"overrides": TINY + list(extra) + [f"checkpoint.path={tmp}/{ckpt}"], "run_dir": f"{tmp}/{name}", **kw}


def train_losses(run_dir: Path) -> dict[int, float]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "split" not in r}


def run_phases(phases: list[dict], shim: bool = False) -> list[dict]:
    """Worker body: for each phase {"overrides", "run_dir", "signal_at": step, "state": bool,
    "expect_error": bool, "remove": [folders deleted before it starts]}, train and report losses (rank 0), start_step, resumed_from,
    stopped_by, the micro-batches trained on (stream positions from the sampler, "samples"; the
    dataset indices of the samples, "idx"), and the full weights (state=True) or the error. A run whose
    micro-batches replay as CUDA graphs calls the forward only to record the graph, so it reports neither
    "samples" nor "idx" (None)."""
    if shim:
        from tests.support.mfsdp_cpu_shim import install

        install()
    import torch

    from core.data.sampling import GlobalBatchSampler
    from core.metrics.logger import MetricsLogger
    from recipes.vit.recipe import ViTRecipe
    from tests.support.helpers import compose_config, train_run

    current: dict = {}
    original_log, original_iter, original_forward = MetricsLogger.log, GlobalBatchSampler.__iter__, ViTRecipe.forward

    def log(self, record, prefix=""):
        original_log(self, record, prefix)
        # Only rank 0 logs: the other rank must learn of the signal through the loop's agreement.
        if self.enabled and not prefix and record.get("step") == current.get("signal_at"):
            os.kill(os.getpid(), signal.SIGTERM)

    def recording_iter(self):
        for batch in original_iter(self):
            current["samples"].append(list(batch))
            yield batch

    def recording_forward(self, model, batch, training):
        if training and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            current["graphed"] = True  # reading the batch on the host cannot be recorded into the graph
        elif training:
            current["idx"].append(batch["idx"].tolist())
        return original_forward(self, model, batch, training)

    MetricsLogger.log, GlobalBatchSampler.__iter__, ViTRecipe.forward = log, recording_iter, recording_forward
    out = []
    try:
        for phase in phases:
            current.clear()
            current.update(signal_at=phase.get("signal_at"), samples=[], idx=[])
            for folder in phase.get("remove", []):
                shutil.rmtree(folder)
            cfg = compose_config(phase.get("config", "vit_sanity"), phase["overrides"])
            try:
                trained_run = train_run(cfg, phase["run_dir"], full_state=phase.get("state", False))
            except Exception as e:  # noqa: BLE001
                if not phase.get("expect_error"):
                    raise
                out.append({"error": f"{type(e).__name__}: {e}", "losses": train_losses(phase["run_dir"])})
                continue
            # The loop fetches one micro-batch ahead (core/data/loading.py): the micro-batches it trained
            # on are the first ones drawn from the sampler, as many as forward passes ran.
            graphed = current.get("graphed", False)
            trained = None if graphed else current["samples"][:len(current["idx"])]
            result = trained_run["result"]
            out.append({"losses": train_losses(phase["run_dir"]), "start_step": result.start_step,
                        "resumed_from": result.resumed_from,
                        "stopped_by": result.stopped_by, "samples": trained, "idx": None if graphed else current["idx"],
                        "skipped_steps": result.skipped_steps, "state": trained_run["state"]})
    finally:
        MetricsLogger.log, GlobalBatchSampler.__iter__, ViTRecipe.forward = original_log, original_iter, original_forward
    return out
