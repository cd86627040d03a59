"""Which run this is: a run is its checkpoint folder (`checkpoint.path`), however many times its command runs
(resumed, requeued by SLURM, extended with more steps).

The first invocation records in that folder, in `run.json`, its run directory and W&B run id; every later
invocation reads them back, so it writes to the same run directory (`hydra.run.dir` resolves through
`recorded_run_dir`), continues the same metrics history (core/metrics/history.py) and the same W&B run.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger("train")

RUN_FILE = "run.json"  # in the checkpoint folder, beside step_<N>/


def read_run_record(checkpoint_path: str | Path) -> dict:
    """The record an earlier invocation left in the checkpoint folder; {} if none (or unreadable: then the run
    starts a new record, and says so)."""
    path = Path(checkpoint_path) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s): this invocation starts a new run record", path, e)
        return {}
    return record if isinstance(record, dict) else {}


def write_run_record(checkpoint_path: str | Path, record: dict) -> None:
    """Replace the record atomically (a crash mid-write leaves the old one)."""
    folder = Path(checkpoint_path)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{RUN_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(temporary, folder / RUN_FILE)


def recorded_run_dir(checkpoint_path: str, default: str) -> str:
    """The run directory of the run whose checkpoints are under `checkpoint_path`, else `default` (a new run)."""
    return read_run_record(checkpoint_path).get("run_dir") or default


def new_wandb_id() -> str:
    return uuid.uuid4().hex[:16]
