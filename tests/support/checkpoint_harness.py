"""Test-side tools for checkpoint tests: train in several phases inside one worker process, observed through the
run's callbacks (a signal sent at a given step, the sample indices each rank trained on)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

from core.training.callbacks import Callback

# A tiny ViT on 48 synthetic images: global batch 16 = 2 ranks x micro-batch 4 x 2 accumulation steps
# (or 1 rank x 4 x 4), so one epoch is 3 steps; warmup ends at step 5.
TINY = [
    "data=synthetic",
    "data.synthetic_train_size=48",
    "data.synthetic_val_size=8",
    "data.num_classes=10",
    "data.num_workers=0",
    "model.backend=torch",
    "precision=fp32",
    "model.hidden_size=32",
    "model.depth=2",
    "model.num_heads=2",
    "training.steps=8",
    "training.global_batch_size=16",
    "training.micro_batch_size=4",
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "optim.lr=3e-3",
    "optim.weight_decay=0.1",
    "optim.eps=1e-5",
    "scheduler.warmup_steps=5",
    "logger.progress_bar=never",
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


class Recorder(Callback):
    """A callback of the run (core/training/callbacks.py): the micro-batches it trained on, as stream positions
    ("samples": what the loader's sampler, core/data/sampling.py, gave for them, in order) and as dataset indices
    ("idx": each batch's "idx" column, where it has one); SIGTERM to this process after the logged step
    `signal_at` on rank 0 only (the other ranks must learn of it through the loop's agreement)."""

    def __init__(self, signal_at=None):
        self.signal_at, self.samples, self.idx, self.positions = signal_at, [], [], None

    def on_train_start(self, run) -> None:
        # The sampler yields the same positions to every iterator: one of our own follows the loader's.
        self.positions = iter(run.data.sampler)

    def on_step_end(self, run, step, micro_batches, record) -> None:
        for batch in micro_batches:
            self.samples.append(next(self.positions))
            if "idx" in batch:
                self.idx.append(batch["idx"].tolist())
        if run.session.is_main and record and step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)


def run_phases(phases: list[dict], shim: bool = False, callbacks: tuple = ()) -> list[dict]:
    """Worker body: for each phase {"overrides", "run_dir", "signal_at": step, "state": bool,
    "expect_error": bool, "remove": [folders deleted before it starts]}, train and report losses (rank 0), start_step,
    resumed_from, stopped_by, the micro-batches trained on (stream positions from the sampler, "samples"; the
    dataset indices of the samples, "idx": see Recorder), and the full weights (state=True) or the error.
    `callbacks`: more observers of every phase's run."""
    if shim:
        from tests.support.mfsdp_cpu_shim import install

        install()
    from tests.support.helpers import compose_config, train_run

    out = []
    for phase in phases:
        for folder in phase.get("remove", []):
            shutil.rmtree(folder)
        seen = Recorder(phase.get("signal_at"))
        cfg = compose_config(phase.get("config", "vit_sanity"), phase["overrides"])
        try:
            trained_run = train_run(
                cfg, phase["run_dir"], full_state=phase.get("state", False), callbacks=(seen, *callbacks)
            )
        except Exception as e:  # noqa: BLE001
            if not phase.get("expect_error"):
                raise
            out.append({"error": f"{type(e).__name__}: {e}", "losses": train_losses(phase["run_dir"])})
            continue
        result = trained_run["result"]
        out.append(
            {
                "losses": train_losses(phase["run_dir"]),
                "start_step": result.start_step,
                "resumed_from": result.resumed_from,
                "stopped_by": result.stopped_by,
                "samples": seen.samples,
                "idx": seen.idx,
                "skipped_steps": result.skipped_steps,
                "state": trained_run["state"],
            }
        )
    return out
