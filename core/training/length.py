"""How long a run is: `training.steps` optimizer steps, or `training.epochs` passes over the training set.

The training stream is one epoch's shuffled order after another (core/data/pipeline.py) and every optimizer
step takes the next global batch from it, so `epochs` passes need epochs x len(train) / global_batch_size
steps; when the global batch does not divide that, the last step also takes the first samples of the next
epoch (every sample is seen at least `epochs` times, and the log says how many samples are extra). Epoch e
ends at the step during which the stream passes e x len(train) samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config.errors import ConfigError


@dataclass(frozen=True)
class RunLength:
    steps: int  # optimizer steps of the whole run
    global_batch_size: int
    dataset_len: int  # training samples in one epoch

    def epochs_done(self, step: int) -> int:
        """Complete passes over the training set after `step` optimizer steps."""
        return step * self.global_batch_size // self.dataset_len

    def ends_epoch(self, step: int, every_n_epochs: int) -> bool:
        """Whether `step` completes an epoch that is a multiple of `every_n_epochs` (0: never)."""
        if every_n_epochs <= 0:
            return False
        return self.epochs_done(step) // every_n_epochs > self.epochs_done(step - 1) // every_n_epochs

    def describe(self, epochs: int | None) -> str:
        """One line for the start of the run."""
        if epochs is None:
            return f"{self.steps} steps ({self.steps * self.global_batch_size / self.dataset_len:.2f} epochs)"
        extra = self.steps * self.global_batch_size - epochs * self.dataset_len
        note = f"; the last step also takes {extra} samples of epoch {epochs + 1}" if extra else ""
        return (
            f"training.epochs={epochs}: {self.steps} steps of {self.global_batch_size} samples over "
            f"{self.dataset_len} training samples{note}"
        )


def run_length(steps: int | None, epochs: int | None, global_batch_size: int, dataset_len: int) -> RunLength:
    """The run's length from training.steps or training.epochs (the config check allows exactly one)."""
    if dataset_len < 1:
        raise ConfigError("the training set is empty")
    if steps is None:
        if epochs is None:
            raise ConfigError("training.steps or training.epochs: give one (how long to train)")
        steps = math.ceil(epochs * dataset_len / global_batch_size)
    return RunLength(steps, global_batch_size, dataset_len)
