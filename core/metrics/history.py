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
    are not records (a half-written line after a crash, bytes that are not UTF-8 text, JSON that is not an
    object with an integer step), byte for byte to metrics.superseded.jsonl beside it. Returns how many lines
    moved."""
    if not metrics.is_file():
        return 0
    kept, moved = [], []
    for line in metrics.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        line_step = _step_of(line)
        (kept if line_step is not None and line_step <= step else moved).append(line)
    if moved:
        with open(metrics.parent / SUPERSEDED, "ab") as f:
            f.write(b"".join(line + b"\n" for line in moved))
        temporary = metrics.with_name(f".{metrics.name}.{os.getpid()}")
        temporary.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(temporary, metrics)
    return len(moved)


def _step_of(line: bytes) -> Optional[int]:
    """The step of a metrics record; None for anything else."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: absurdly nested
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if type(step) is int else None  # not a bool, which Python counts as an int
