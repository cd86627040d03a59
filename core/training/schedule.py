"""Which optimizer steps log, validate and save: the loop's decisions, from the config and the run's length.

train.train asks this at the end of every step (a save is also made when a stop signal arrives); the config
check asks whether a run validates at all before it starts (core/config/validation.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from core.training.length import RunLength


@dataclass(frozen=True)
class StepSchedule:
    length: RunLength  # the run's optimizer steps and where its epochs end
    log_every_n_steps: int
    val_every_n_steps: int  # 0: never by steps
    val_every_n_epochs: int  # 0: never by epochs
    val_at_end: bool
    save_every_n_steps: int  # 0: never by steps
    save_every_n_epochs: int  # 0: never by epochs
    save_final: bool

    @classmethod
    def from_config(cls, cfg: DictConfig, length: RunLength) -> "StepSchedule":
        training, checkpoint = cfg.training, cfg.checkpoint
        return cls(
            length,
            training.log_every_n_steps,
            training.val_every_n_steps,
            training.val_every_n_epochs,
            training.val_at_end,
            checkpoint.save_every_n_steps,
            checkpoint.save_every_n_epochs,
            checkpoint.save_final,
        )

    def logs(self, step: int) -> bool:
        """Every log_every_n_steps steps, and the last step."""
        return step % self.log_every_n_steps == 0 or step == self.length.steps

    def validates(self, step: int) -> bool:
        """Every val_every_n_steps steps, at the end of every val_every_n_epochs-th epoch, and at the last step
        with val_at_end."""
        return (
            (self.val_every_n_steps > 0 and step % self.val_every_n_steps == 0)
            or self.length.ends_epoch(step, self.val_every_n_epochs)
            or (self.val_at_end and step == self.length.steps)
        )

    def saves(self, step: int) -> bool:
        """Every save_every_n_steps steps, at the end of every save_every_n_epochs-th epoch, and at the last step
        with save_final."""
        return (
            (self.save_every_n_steps > 0 and step % self.save_every_n_steps == 0)
            or self.length.ends_epoch(step, self.save_every_n_epochs)
            or (self.save_final and step == self.length.steps)
        )

    def validates_at_all(self) -> bool:
        """Whether any of the run's steps validates (without going through them)."""
        steps = self.length.steps
        return (
            self.val_at_end
            or 0 < self.val_every_n_steps <= steps
            or 0 < self.val_every_n_epochs <= self.length.epochs_done(steps)
        )
