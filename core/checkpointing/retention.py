"""Which complete checkpoints to keep after a save (`checkpoint.keep_*`)."""

from __future__ import annotations

import math
from typing import Optional


def checkpoints_to_keep(
    entries: list[tuple[int, Optional[float]]],
    keep_last_n: int,
    keep_every_n_steps: int,
    keep_best_k: int,
    mode: str,
    protected: set[int],
) -> set[int]:
    """Steps to keep among complete checkpoints `entries` = [(step, monitored value or None)]."""
    steps = sorted(step for step, _ in entries)
    keep = set(protected) | (set(steps) if keep_last_n < 0 else set(steps[-keep_last_n:]))
    if keep_every_n_steps > 0:
        keep |= {s for s in steps if s % keep_every_n_steps == 0}
    # A NaN never ranks (it compares false with everything, so sorting would place it anywhere).
    scored = [
        (value if mode == "min" else -value, step)
        for step, value in entries
        if value is not None and not math.isnan(value)
    ]
    keep |= {step for _, step in sorted(scored)[:keep_best_k]}
    if steps:
        keep.add(steps[-1])  # the newest: what a restart resumes from
    return keep


def set_aside_to_delete(set_aside: list[tuple[int, bool]], newest_complete: int, keep_last_n: int) -> list[int]:
    """Which of this tool's set-aside folders `set_aside` = [(step, complete)] (step_<N>.superseded) to delete,
    by position, once the run has completed a checkpoint of step `newest_complete`: every interrupted save (it holds
    nothing usable), and, unless every checkpoint is kept (keep_last_n=-1), every complete one the run's own
    checkpoints have caught up with (a step <= the newest)."""
    return [
        i
        for i, (step, complete) in enumerate(set_aside)
        if not complete or (keep_last_n >= 0 and step <= newest_complete)
    ]
