"""One run, one metrics history, however many times its command runs (resumed, requeued, extended).

Resumed from step N, the run's `metrics.jsonl` keeps the records of steps <= N; those after N, written by an
invocation whose later checkpoints are gone (interrupted, or deleted to go back), move to
`metrics.superseded.jsonl`, so `metrics.jsonl` reads as one clean history and nothing is lost. Every
invocation of a run writes to the same run directory: core/config/run_record.py.

Neither file is ever read or written through a symbolic link: a run directory named by run.json may be one
someone else prepared, and a link there would copy a file only this user can read into a readable one, or
append to it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Optional

from core.config.errors import ConfigError

SUPERSEDED = "metrics.superseded.jsonl"
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # open() fails (ELOOP) on a link: no window between check and use


def refuse_links(metrics: Path) -> None:
    """ConfigError if `metrics` or metrics.superseded.jsonl beside it is a symbolic link; checked before either
    is opened."""
    for path in (metrics, metrics.parent / SUPERSEDED):
        if path.is_symlink():
            raise ConfigError(
                f"{path} is a symbolic link (to {os.readlink(path)}): a run never reads or writes "
                "its metrics history through a link, which could expose or change another file. "
                "Nothing was read from it or written through it; replace the link with the file "
                "itself (or remove it) and start again"
            )


def open_for_append(path: Path, mode: str = "a", **kwargs):
    """`open(path, mode, **kwargs)` to append, never through a symbolic link (ConfigError if it is one)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_FOLLOW, 0o666)
    except OSError:
        refuse_links(path)  # a link created since the check: the clear message
        raise
    return os.fdopen(fd, mode, **kwargs)


def keep_history_up_to(metrics: Path, step: int) -> int:
    """Keep the records of steps <= `step` in `metrics` (a JSON-lines file) and move the others, and lines that
    are not records (a half-written line after a crash, bytes that are not UTF-8 text, JSON that is not an
    object with an integer step), byte for byte to metrics.superseded.jsonl beside it. Returns how many lines
    moved. ConfigError if either file is a symbolic link."""
    refuse_links(metrics)
    if not metrics.is_file():
        return 0
    with os.fdopen(os.open(metrics, os.O_RDONLY | NO_FOLLOW), "rb") as f:
        content = f.read()
    kept, moved = [], []
    for line in content.split(b"\n"):
        if not line.strip():
            continue
        line_step = _step_of(line)
        (kept if line_step is not None and line_step <= step else moved).append(line)
    if moved:
        with open_for_append(metrics.parent / SUPERSEDED, "ab") as f:
            f.write(b"".join(line + b"\n" for line in moved))
        # A fresh name: "x" fails on an existing name, a planted link included, where a fixed one is written through
        temporary = metrics.with_name(f".{metrics.name}.{uuid.uuid4().hex}")
        try:
            with open(temporary, "xb") as f:
                f.write(b"".join(line + b"\n" for line in kept))
            os.replace(temporary, metrics)
        finally:
            temporary.unlink(missing_ok=True)
    return len(moved)


def _step_of(line: bytes) -> Optional[int]:
    """The step of a metrics record; None for anything else."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: absurdly nested
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if type(step) is int else None  # not a bool, which Python counts as an int
