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
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.config.file_shape import problems

log = logging.getLogger("train")

RUN_FILE = "run.json"  # in the checkpoint folder, beside step_<N>/


class RunRecord(BaseModel):
    """What run.json holds. Fields a later version adds are kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow")
    run_dir: Annotated[str, Field(min_length=1)]
    wandb_id: Optional[str] = None  # written once the run has logged to W&B; null reads as none


def read_run_record(checkpoint_path: str | Path, warn: bool = True) -> dict:
    """The record an earlier invocation left in the checkpoint folder; {} if there is none, or if it is not a
    run record (then, with `warn`, a warning says that this invocation starts a new record)."""
    path = Path(checkpoint_path) / RUN_FILE
    try:
        return RunRecord.model_validate_json(path.read_bytes()).model_dump(exclude_none=True)
    except FileNotFoundError:
        return {}
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    except ValidationError as e:
        problem = problems(e)
    if warn:
        log.warning("%s is not a run record (%s; expected a JSON object with run_dir, a string, and optionally "
                    "wandb_id, a string): this invocation starts a new run record, with its own run directory and "
                    "W&B run, and replaces the file", path, problem)
    return {}


def write_run_record(checkpoint_path: str | Path, record: dict) -> None:
    """Replace the record atomically (a crash mid-write leaves the old one)."""
    folder = Path(checkpoint_path)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{RUN_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(temporary, folder / RUN_FILE)


def recorded_run_dir(checkpoint_path: str, default: str) -> str:
    """The run directory of the run whose checkpoints are under `checkpoint_path`, else `default` (a new run).
    Silent: this runs in a Hydra resolver, on every rank and before logging is set up; MetricsLogger.open
    reads the record again on rank 0 and warns there."""
    return read_run_record(checkpoint_path, warn=False).get("run_dir") or default


def new_wandb_id() -> str:
    return uuid.uuid4().hex[:16]
