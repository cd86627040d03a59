"""Where metrics go: stdout, `<run dir>/metrics.jsonl`, Weights & Biases, and a progress bar.

Only rank 0 writes; the loop hands it plain floats (already reduced over ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from core.config import LoggerConfig

log = logging.getLogger("train")

# Dense bf16 tensor-core peak per GPU (FLOP/s), from the vendors' datasheets (SXM parts).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak, or None when unknown (CPU, unlisted GPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _format(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"{key} {100 * value:.1f}%"
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:,.0f}"
    return f"{key} {value}"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggerConfig, enabled: bool, total_steps: int, start_step: int,
                 config: dict, run_name: str):
        self.cfg, self.enabled = cfg, enabled
        self.jsonl = None
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        if cfg.jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        show_bar = cfg.progress_bar == "always" or (cfg.progress_bar == "auto" and sys.stdout.isatty())
        if cfg.progress_bar not in ("auto", "always", "never"):
            raise ValueError(f"logger.progress_bar={cfg.progress_bar!r}: expected auto, always or never")
        if show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if cfg.wandb.enabled:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_name,
                group=cfg.wandb.group, tags=list(cfg.wandb.tags), mode=cfg.wandb.mode, dir=str(run_dir),
                config=config,
            )

    def log(self, record: dict[str, Any], prefix: str = "") -> None:
        """Write one record ({"step": n, ...}); `prefix` (e.g. "val") labels stdout and W&B keys."""
        if not self.enabled:
            return
        if self.jsonl is not None:
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


class PhaseTimer:
    """Seconds spent per phase of the step ("forward_backward", "grad_sync", ...), when enabled.

    Synchronises the device at each phase boundary, which costs a little speed: meant for
    benchmarks (training.time_phases=true), off by default.
    """

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.totals: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def pop_means(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each phase since the last call, as "time_<phase>" entries."""
        out = {f"time_{k}": v / steps for k, v in self.totals.items()}
        self.totals = {}
        return out
