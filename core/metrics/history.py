"""One run, one metrics history, however many times its command runs (resumed, requeued, extended).

Resumed from step N, the run's `metrics.jsonl` keeps the records of steps <= N; those after N, written by an
invocation whose later checkpoints are gone (interrupted, or deleted to go back), move to
`metrics.superseded.jsonl`, so `metrics.jsonl` reads as one clean history and nothing is lost. Every
invocation of a run writes to the same run directory: core/config/run_record.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

SUPERSEDED = "metrics.superseded.jsonl"


def keep_history_up_to(metrics: Path, step: int) -> int:
    """Keep the records of steps <= `step` in `metrics` (a JSON-lines file) and move the others, and lines that
    are not records (a half-written line after a crash), to metrics.superseded.jsonl beside it. Returns how
    many lines moved."""
    if not metrics.is_file():
        return 0
    kept, moved = [], []
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        (kept if _step_of(line) is not None and _step_of(line) <= step else moved).append(line)
    if moved:
        with open(metrics.parent / SUPERSEDED, "a") as f:
            f.write("".join(line + "\n" for line in moved))
        temporary = metrics.with_name(f".{metrics.name}.{os.getpid()}")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, metrics)
    return len(moved)


def _step_of(line: str) -> Optional[int]:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
