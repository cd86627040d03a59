"""Callbacks: what observes a training run. train.py calls every callback of the run at these points, in
order, on every rank:

    on_train_start(run)                                    setup done (checkpoint restored), before the first step
    on_step_end(run, step, micro_batches, record)          after optimizer step `step`; `record`: what the step
                                                           logged (loss, lr, grad_norm, throughput...) at a
                                                           logging step, else {}
    on_validation_end(run, step, metrics)                  after a validation: its metrics (the same on every rank)
    on_save(run, step, stall_s)                            after a save of checkpoint.path/step_<step> was handed
                                                           off (an async save completes in the background)
    on_train_end(run, result)                              after the loop ended normally (not after an error)

`run` is train.Run: `run.state` (step, consumed_samples, ...), `run.session.cfg`, `run.parallel.model`, ...
`run.request_stop(reason)` asks the run to stop as a stop signal does: every rank agrees at the next step's end,
saves that step and leaves (the same command resumes it). The metrics logger and the throughput meter are
callbacks; users add theirs with `training.callbacks` (docs/callbacks.md), tests observe runs the same way.
"""

from __future__ import annotations

from typing import Any, Iterable

from omegaconf import OmegaConf

from core.config.errors import ConfigError
from core.config.import_path import split_target


class Callback:
    """Override what you need; every method is a no-op here."""

    def on_train_start(self, run) -> None:
        pass

    def on_step_end(self, run, step: int, micro_batches: list[dict], record: dict[str, float]) -> None:
        pass

    def on_validation_end(self, run, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_save(self, run, step: int, stall_s: float) -> None:
        pass

    def on_train_end(self, run, result) -> None:
        pass


class Callbacks(Callback):
    """The run's callbacks, called in order."""

    def __init__(self, callbacks: Iterable[Callback]):
        self.callbacks = list(callbacks)

    def on_train_start(self, run) -> None:
        for callback in self.callbacks:
            callback.on_train_start(run)

    def on_step_end(self, run, step: int, micro_batches: list[dict], record: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_step_end(run, step, micro_batches, record)

    def on_validation_end(self, run, step: int, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_validation_end(run, step, metrics)

    def on_save(self, run, step: int, stall_s: float) -> None:
        for callback in self.callbacks:
            callback.on_save(run, step, stall_s)

    def on_train_end(self, run, result) -> None:
        for callback in self.callbacks:
            callback.on_train_end(run, result)


# ---- training.callbacks: the user's callbacks, by import path


def _split(entry: Any, key: str) -> tuple[type, dict]:
    """An entry of training.callbacks: the Callback class it names, and its arguments."""
    cls, arguments = split_target(entry, key)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        path = entry["_target_"] if isinstance(entry, dict) else entry
        raise ConfigError(
            f"{key}={path}: a {type(cls).__name__}, expected a subclass of core.training.callbacks.Callback"
        )
    return cls, arguments


def _plain(entries: Any) -> list:
    return OmegaConf.to_container(entries, resolve=True) if OmegaConf.is_config(entries) else list(entries)


def build_callbacks(entries: Any, key: str = "training.callbacks") -> list[Callback]:
    """The callbacks training.callbacks lists (import paths or {_target_, arguments}), made (the config's check
    found each import path; here each must name a Callback class that takes the arguments)."""
    made = []
    for i, entry in enumerate(_plain(entries)):
        cls, arguments = _split(entry, f"{key}[{i}]")
        try:
            made.append(cls(**arguments))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}[{i}]: {cls.__module__}.{cls.__qualname__}({', '.join(arguments)}): {e}") from None
    return made
