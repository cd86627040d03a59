"""Torch DCP checkpoints: `<checkpoint.path>/step_<N>/`.

Layout (the same for every backend): "model" holds the weights by their names in the user's model
(no wrapper prefix such as `module.`), "optim" the optimizer state keyed by those names, "scheduler"
and "train_state" the loop's position. Rank 0 writes the resolved config next to DCP's files and a
`COMPLETE` marker last, after every rank finished writing, so a checkpoint without the marker is
partial and must not be used.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf

from core.config import CheckpointConfig, ConfigError
from core.parallel import Parallel

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


def step_dirs(path: Path) -> list[Path]:
    """Existing step_<N> folders under path, oldest first."""
    if not path.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in path.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, is_main: bool):
        self.cfg, self.is_main = cfg, is_main
        self.path = Path(cfg.path)
        existing = step_dirs(self.path)
        if existing:
            # Never overwrite another run's checkpoints silently.
            raise ConfigError(
                f"checkpoint.path={self.path} already holds checkpoints ({existing[-1].name}, ...) of another run; "
                "choose a new checkpoint.path or remove them"
            )

    def should_save(self, step: int, last_step: int) -> bool:
        periodic = self.cfg.save_every_n_steps > 0 and step % self.cfg.save_every_n_steps == 0
        return periodic or (self.cfg.save_final and step == last_step)

    def save(self, step: int, parallel: Parallel, optimizer: torch.optim.Optimizer, scheduler: Any,
             train_state: dict, config: DictConfig) -> Path:
        target = self.path / f"step_{step}"
        state = {
            "model": parallel.model_state_dict(),
            "optim": parallel.optimizer_state_dict(optimizer),
            "scheduler": scheduler.state_dict(),
            "train_state": train_state,
        }
        dcp.save(state, checkpoint_id=target)
        dist.barrier()  # every rank's shards are on disk before the marker says so
        if self.is_main:
            OmegaConf.save(config, target / "config.yaml", resolve=True)
            (target / COMPLETE_MARKER).write_text(f"step {step}\n")
            log.info("saved checkpoint %s", target)
        return target
