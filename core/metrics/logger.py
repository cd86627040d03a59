"""Where metrics go: stdout, `<run dir>/metrics.jsonl`, Weights & Biases, and a progress bar.

Only rank 0 writes; the loop hands it plain floats (already reduced over ranks).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from core.config.schema import LoggerConfig, ProgressBar

log = logging.getLogger("train")


def _format(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"{key} {100 * value:.1f}%"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:,.0f}"
    return f"{key} {value}"


class MetricsLogger:
    """Writes on rank 0 (`enabled`); a no-op elsewhere."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, enabled: bool, config: dict, run_name: str):
        self.cfg, self.enabled = cfg, enabled
        self.jsonl = None
        self.bar = None
        self.wandb = None
        self.jsonl_path = run_dir / "metrics.jsonl"  # opened at the first record: no empty file from a failed start
        if not enabled:
            return
        if cfg.wandb.enabled:
            import wandb

            mode = None if cfg.wandb.mode is None else str(cfg.wandb.mode)
            self.wandb = wandb.init(
                project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_name,
                group=cfg.wandb.group, tags=list(cfg.wandb.tags), mode=mode, dir=str(run_dir), config=config,
            )

    def log(self, record: dict[str, Any], prefix: str = "") -> None:
        """Write one record ({"step": n, ...}); `prefix` (e.g. "val") labels stdout and W&B keys."""
        if not self.enabled:
            return
        if self.cfg.jsonl:
            if self.jsonl is None:
                self.jsonl = open(self.jsonl_path, "a", buffering=1)
            self.jsonl.write(json.dumps({**record, **({"split": prefix} if prefix else {})}) + "\n")
        if self.cfg.stdout:
            fields = " | ".join(_format(k, v) for k, v in record.items() if k != "step")
            line = f"{prefix + ' ' if prefix else ''}step {record['step']} | {fields}"
            if self.bar is not None:
                self.bar.write(line)
            else:
                log.info(line)
        if self.wandb is not None:
            key = (prefix + "/") if prefix else "train/"
            self.wandb.log({key + k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def start_progress(self, first_step: int, total_steps: int) -> None:
        """Show a progress bar from `first_step` (logger.progress_bar: auto shows it in a terminal)."""
        show = self.cfg.progress_bar == ProgressBar.always or (self.cfg.progress_bar == ProgressBar.auto
                                                               and sys.stdout.isatty())
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
