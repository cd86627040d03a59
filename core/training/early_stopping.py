"""Early stopping on a validation metric, as a callback (core/training/callbacks.py; docs/callbacks.md):

    training.callbacks='[{_target_: core.training.early_stopping.EarlyStopping, monitor: val/loss, patience: 3}]'

After `patience` validations in a row that do not improve on the best value by more than `min_delta`, the run stops
as on a stop signal: it saves the next step and ends; the same command resumes it (with the patience counted anew).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from core.config.errors import ConfigError
from core.training.callbacks import Callback

log = logging.getLogger("train")


class EarlyStopping(Callback):
    def __init__(self, monitor: str = "val/loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if not (isinstance(monitor, str) and monitor.startswith("val/") and len(monitor) > 4):
            raise ValueError(f"monitor={monitor!r}: expected val/<a validation metric>, e.g. val/loss")
        if type(patience) is not int or patience < 1:
            raise ValueError(f"patience={patience!r}: expected a whole number >= 1")
        if not (isinstance(min_delta, (int, float)) and math.isfinite(min_delta) and min_delta >= 0):
            raise ValueError(f"min_delta={min_delta!r}: expected a number >= 0")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: expected min (lower is better) or max")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, float(min_delta), mode
        self.best: Optional[float] = None
        self.bad_validations = 0  # in a row, since the best

    def on_train_start(self, run) -> None:
        if run.data.val_loader is None:
            raise ConfigError(
                f"training.callbacks: EarlyStopping watches {self.monitor}, but this run does not "
                "validate (no validation set, or training.limit_val_batches=0)"
            )

    def on_validation_end(self, run, step: int, metrics: dict[str, float]) -> None:
        name = self.monitor.removeprefix("val/")
        if name not in metrics:
            raise ConfigError(
                f"training.callbacks: EarlyStopping monitor={self.monitor!r} is not a validation metric "
                f"of this run; there are: {', '.join(f'val/{k}' for k in sorted(metrics))}"
            )
        value = metrics[name]
        if self.best is None or self._improves(value):
            self.best, self.bad_validations = value, 0
            return
        self.bad_validations += 1
        if self.bad_validations >= self.patience:
            run.request_stop(
                f"early stopping ({self.monitor} {value:.4g} at step {step}, best {self.best:.4g}: "
                f"no improvement by more than {self.min_delta:g} in {self.patience} validations)"
            )

    def _improves(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta
