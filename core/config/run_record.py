"""Which run this is: a run is its checkpoint folder (`checkpoint.path`), however many times its command runs
(resumed, requeued by SLURM, extended with more steps).

The first invocation records in that folder, in `run.json`, its run directory and W&B run id; every later
invocation reads them back, so it writes to the same run directory (`hydra.run.dir` resolves through
`recorded_run_dir`), continues the same metrics history (core/metrics/history.py) and the same W&B run.

run.json also names the checkpoint folder it was written in: a copied (or moved) folder carries the record of
another run, whose run directory the copy's run must not write to, so such a record is not followed. Its
values are plain paths and ids: one holding `${` would be resolved by Hydra (run_dir becomes hydra.run.dir).
Whoever can write the checkpoint folder can write run.json, so the directory it names is followed only if it
is this user's own (or gone) and neither it nor the files a run writes in it are symbolic links: a run never
writes its logs through a link someone else placed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.config.errors import ConfigError
from core.config.file_shape import NotThisKindOfFile, problems, read_small_file

log = logging.getLogger("train")

RUN_FILE = "run.json"  # in the checkpoint folder, beside step_<N>/
MAX_BYTES = 1024 * 1024  # a run record is some 200 bytes
# What an invocation writes in its run directory (Hydra's log and .hydra/, the session's and the logger's files).
RUN_DIR_FILES = (
    "train.log",
    ".hydra",
    "resolved_config.yaml",
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    "tensorboard",
    "wandb",
)


def _absolute(path: Optional[str]) -> Optional[str]:
    if path is not None and not os.path.isabs(path):
        raise ValueError("should be an absolute path (a run records its folders resolved)")
    return path


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    return [s for v in value for s in _strings(v)] if isinstance(value, list) else []


class RunRecord(BaseModel):
    """What run.json holds. Fields a later version adds are kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow")
    run_dir: Annotated[str, Field(min_length=1), AfterValidator(_absolute)]
    wandb_id: Optional[str] = None  # written once the run has logged to W&B; null reads as none
    # The checkpoint folder the record was written in (absolute, resolved); records of earlier versions lack it
    # and are not followed (read_run_record).
    checkpoint_path: Annotated[Optional[str], AfterValidator(_absolute)] = None

    @model_validator(mode="after")
    def _no_interpolation(self) -> RunRecord:
        if any("${" in s for s in _strings(self.model_dump())):
            raise ValueError(
                "a value holds `${`, an OmegaConf interpolation, which Hydra would resolve; a run "
                "writes plain paths and ids"
            )
        return self


def read_run_record(checkpoint_path: str | Path, warn: bool = True) -> dict:
    """The record an earlier invocation left in the checkpoint folder; {} if there is none, if it is not a run
    record, or if it was written for another checkpoint folder (this one is a copy of it, or was moved) or by an
    earlier version that did not name its folder. Then,
    with `warn`, a warning says why this invocation starts a new record."""
    path = Path(checkpoint_path) / RUN_FILE
    try:
        record = RunRecord.model_validate_json(read_small_file(path, MAX_BYTES)).model_dump(exclude_none=True)
    except FileNotFoundError:
        return {}
    except NotThisKindOfFile as e:  # a FIFO, a link, a directory: not read, so never a hang or a flood
        problem = str(e)
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    except ValidationError as e:
        problem = problems(e)
    else:
        recorded = record.get("checkpoint_path")
        if recorded is None:  # an earlier version's record: an original cannot be told from a copy
            if warn:
                log.warning(
                    "%s was written by an earlier version of this tool, without the checkpoint folder it "
                    "belongs to, so this folder cannot be told from a copy of it: this invocation does not "
                    "write to the run directory it names (%s); it starts a new run record, with its own run "
                    "directory and W&B run, and replaces the file",
                    path,
                    record["run_dir"],
                )
            return {}
        if _same_folder(recorded, checkpoint_path):
            problem = _run_dir_problem(record["run_dir"])
            if problem is None:
                return record
            if warn:
                log.warning(
                    "%s names the run directory %s, but %s: this invocation does not write there; it starts "
                    "a new run record, with its own run directory and W&B run, and replaces the file",
                    path,
                    record["run_dir"],
                    problem,
                )
            return {}
        if warn:
            log.warning(
                "%s was written for the checkpoint folder %s, not for %s (a copy of it, or moved here): "
                "this invocation does not write to that run's directory %s; it starts a new run record, "
                "with its own run directory and W&B run, and replaces the file",
                path,
                recorded,
                Path(checkpoint_path).resolve(),
                record["run_dir"],
            )
        return {}
    if warn:
        log.warning(
            "%s is not a run record (%s; expected a JSON object with run_dir, an absolute path, and "
            "optionally wandb_id, a string, and checkpoint_path, an absolute path): this invocation starts "
            "a new run record, with its own run directory and W&B run, and %s",
            path,
            problem,
            "stops where it would replace it (a directory)" if path.is_dir() else "replaces the file",
        )
    return {}


def _run_dir_problem(run_dir: str) -> Optional[str]:
    """Why a recorded run directory must not be written to, or None (it is this user's own, or gone)."""
    try:
        info = os.lstat(run_dir)
    except FileNotFoundError:
        return None  # recreated; MetricsLogger.open says the earlier history is missing
    except OSError as e:
        return f"it cannot be examined ({type(e).__name__}: {e})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return "it belongs to another user"
    links = [name for name in RUN_DIR_FILES if os.path.islink(os.path.join(run_dir, name))]
    return (
        f"{', '.join(links)} in it {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}"
        if links
        else None
    )


def _same_folder(recorded: str, checkpoint_path: str | Path) -> bool:
    here = Path(checkpoint_path).resolve()
    if Path(recorded) == here:
        return True
    try:  # the same folder under another name (a bind mount); a copy is another folder
        return os.path.samefile(recorded, here)
    except OSError:
        return False


def write_run_record(checkpoint_path: str | Path, record: dict) -> None:
    """Replace the record atomically (a crash mid-write leaves the old one), naming this checkpoint folder in
    it. ConfigError if run.json is a directory (a rename cannot replace one; nothing is left behind)."""
    folder = Path(checkpoint_path)
    folder.mkdir(parents=True, exist_ok=True)
    record = {**record, "checkpoint_path": str(folder.resolve())}
    target = folder / RUN_FILE
    if target.is_dir() and not target.is_symlink():
        raise ConfigError(
            f"{target} is a directory, not a run record, so this run cannot record its run directory "
            f"there. Look inside, remove it (rm -r {target}) and start again"
        )
    # A fresh name: "x" fails on any existing name, a symbolic link planted in a shared folder included, where
    # a fixed name would be written through.
    temporary = folder / f".{RUN_FILE}.{uuid.uuid4().hex}"
    try:
        with open(temporary, "x") as f:
            f.write(json.dumps(record, indent=1) + "\n")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def recorded_run_dir(checkpoint_path: str, default: str) -> str:
    """The run directory of the run whose checkpoints are under `checkpoint_path`, else `default` (a new run).
    Silent: this runs in a Hydra resolver, on every rank and before logging is set up; MetricsLogger.open
    reads the record again on rank 0 and warns there."""
    return read_run_record(checkpoint_path, warn=False).get("run_dir") or default


def new_wandb_id() -> str:
    return uuid.uuid4().hex[:16]
