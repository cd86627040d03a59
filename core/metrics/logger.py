"""Where metrics go: stdout, `<run dir>/metrics.jsonl`, Weights & Biases, TensorBoard, and a progress bar.

Only rank 0 writes; the loop hands it plain floats (already reduced over ranks), as one of the run's callbacks
(core/training/callbacks.py): a step's record, validation metrics, a save's stall. `open(start_step, ...)`,
once the run knows where it starts, continues the run's history: metrics.jsonl keeps the steps up to the
one resumed from (core/metrics/history.py), W&B continues the run id kept in the checkpoint folder
(core/config/run_record.py) and TensorBoard drops the events after that step.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from core.config.run_record import RUN_FILE, new_wandb_id, read_run_record, write_run_record
from core.config.schema import LoggerConfig, ProgressBar
from core.metrics.history import SUPERSEDED, keep_history_up_to, open_for_append, refuse_links
from core.training.callbacks import Callback

log = logging.getLogger("train")


def _format(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"{key} {100 * value:.1f}%"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:,.0f}"
    return f"{key} {value}"


class MetricsLogger(Callback):
    """Writes on rank 0 (`enabled`); a no-op elsewhere. Nothing is opened before `open`."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, enabled: bool, config: dict, checkpoint_path: str):
        self.cfg, self.enabled, self.run_dir, self.config = cfg, enabled, run_dir, config
        self.checkpoint_path = checkpoint_path  # where the run's record (run dir, W&B id) is kept
        self.jsonl = None
        self.bar = None
        self.wandb = None
        self.tensorboard = None
        self.jsonl_path = run_dir / "metrics.jsonl"  # opened at the first record: no empty file from a failed start

    def open(self, start_step: int, resumed: bool) -> None:
        """Continue the run's history at `start_step` (0: from the beginning) and record this invocation in the
        checkpoint folder. `resumed`: the weights came from this run's own checkpoint (else a new W&B run)."""
        if not self.enabled:
            return
        if self.cfg.jsonl:
            refuse_links(self.jsonl_path)  # before anything reads or writes them, a clear stop
        record = read_run_record(self.checkpoint_path)
        if self.cfg.jsonl and start_step > 0 and not self.jsonl_path.is_file():
            self._warn_history_missing(record.get("run_dir"), start_step)
        if self.cfg.jsonl:
            moved = keep_history_up_to(self.jsonl_path, start_step)
            if moved:
                log.info(
                    "%s continues after step %d: %d later records moved to %s",
                    self.jsonl_path,
                    start_step,
                    moved,
                    SUPERSEDED,
                )
        record["run_dir"] = str(self.run_dir.resolve())
        if self.cfg.wandb.enabled:
            record["wandb_id"] = self._open_wandb(record.get("wandb_id") if resumed else None)
        if self.cfg.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events at or after it from earlier invocations of the run.
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        write_run_record(self.checkpoint_path, record)

    def _warn_history_missing(self, recorded: str | None, start_step: int) -> None:
        """A run resumed into a run directory without metrics.jsonl: say where the earlier history went."""
        run_file = Path(self.checkpoint_path) / RUN_FILE
        here = str(self.run_dir.resolve())
        if recorded == here:
            why = (
                f"{run_file} names {here} as this run's directory, but it held no metrics.jsonl when this "
                "invocation started: the directory was deleted or moved, or the file removed"
            )
        elif recorded:
            why = f"{run_file} names {recorded} as this run's directory: the earlier history may be there"
        else:
            why = f"{run_file} names no run directory of this checkpoint folder"
        log.warning(
            "resuming at step %d, but the metrics history of earlier invocations (steps up to %d) is not "
            "in %s (%s). This invocation writes its records there from step %d on, and later invocations "
            "of the run continue in that directory",
            start_step,
            start_step,
            self.jsonl_path,
            why,
            start_step + 1,
        )

    def _open_wandb(self, run_id: str | None) -> str:
        import wandb

        wandb_cfg = self.cfg.wandb
        mode = None if wandb_cfg.mode is None else str(wandb_cfg.mode)
        self.wandb = wandb.init(
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            name=wandb_cfg.name or self.run_dir.name,
            group=wandb_cfg.group,
            tags=list(wandb_cfg.tags),
            mode=mode,
            dir=str(self.run_dir),
            config=self.config,
            id=run_id or new_wandb_id(),
            resume="allow",
        )
        if run_id:
            log.info("continuing W&B run %s", run_id)
        return self.wandb.id

    def log(self, record: dict[str, Any], prefix: str = "") -> None:
        """Write one record ({"step": n, ...}); `prefix` (e.g. "val") labels stdout and W&B keys."""
        if not self.enabled:
            return
        if self.cfg.jsonl:
            if self.jsonl is None:
                self.jsonl = open_for_append(self.jsonl_path, "a", buffering=1)
            self.jsonl.write(json.dumps({**record, **({"split": prefix} if prefix else {})}) + "\n")
        if self.cfg.stdout:
            fields = " | ".join(_format(k, v) for k, v in record.items() if k != "step")
            line = f"{prefix + ' ' if prefix else ''}step {record['step']} | {fields}"
            if self.bar is not None:
                self.bar.write(line)
            else:
                log.info(line)
        key = (prefix + "/") if prefix else "train/"
        scalars = {key + k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, record["step"])

    # ---- as a callback of the run

    def on_train_start(self, run) -> None:
        self.start_progress(run.state.step, run.length.steps)

    def on_step_end(self, run, step: int, micro_batches: list[dict], record: dict[str, float]) -> None:
        self.advance()
        if record:
            self.log({"step": step, **record})

    def on_validation_end(self, run, step: int, metrics: dict[str, float]) -> None:
        self.log({"step": step, **metrics}, prefix="val")

    def on_save(self, run, step: int, stall_s: float) -> None:
        self.log({"step": step, "stall_s": stall_s}, prefix="checkpoint")

    def start_progress(self, first_step: int, total_steps: int) -> None:
        """Show a progress bar from `first_step` (logger.progress_bar: auto shows it in a terminal)."""
        show = self.cfg.progress_bar == ProgressBar.always or (
            self.cfg.progress_bar == ProgressBar.auto and sys.stdout.isatty()
        )
        if self.enabled and show:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
