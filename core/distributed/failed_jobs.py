"""A multirun outlives a failed job: the job's error is logged as its one line, the next job runs, and the
sweep ends with the list of its failed jobs and a non-zero exit code.

Inside a multirun job, `session.exit_on_error` raises `JobFailed` instead of leaving the process (a SystemExit
would end the jobs after it too); Hydra's launcher records the failure and starts the next job. `FailedJobs`, a
Hydra callback (configs/train_defaults.yaml), writes each failed job's record into the job's output directory,
where the launching process reads it back also when the jobs ran elsewhere (hydra-submitit-launcher on SLURM);
`finish`, called by launch.run_hydra as the process ends, prints the list and gives the exit code.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback

RECORD = "job_failed.json"  # in a failed job's output directory
log = logging.getLogger("train")
_sweep_dir: Optional[Path] = None  # set in the process that launches a multirun


class JobFailed(CompactHydraException):
    """A multirun job ended by an error the user can fix; Hydra shows it as this one line."""

    def __init__(self, code: int, job: str, error: str):
        super().__init__(f"job {job} failed: {error}")
        self.code, self.error = code, error


def in_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_id() -> str:
    from core.distributed.launch import run_id

    return run_id()


class FailedJobs(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        global _sweep_dir
        _sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN or job_return.status != JobStatus.FAILED:
            return
        error = job_return._return_value
        if isinstance(error, JobFailed):
            code, line = error.code, error.error  # logged by exit_on_error already
        else:  # not an error of the kind a user fixes: its traceback, which Hydra keeps to itself until the end
            code, line = 1, f"{type(error).__name__}: {error}".splitlines()[0]
            log.error("job %s failed", config.hydra.job.num, exc_info=error)
        from core.distributed.launch import global_rank

        if global_rank() == 0:
            record = {
                "run_id": _run_id(),
                "job": int(config.hydra.job.num),
                "code": code,
                "error": line,
                "overrides": _swept(list(config.hydra.overrides.task)),
            }
            Path(str(config.hydra.runtime.output_dir), RECORD).write_text(json.dumps(record) + "\n")
            log.error("job %d failed; the sweep goes on with the next job", record["job"])


def _records(sweep_dir: Path) -> list[dict]:
    """This launch's failed jobs (a sweep folder used again may hold an earlier launch's records), by number."""
    found = []
    for file in sweep_dir.rglob(RECORD):
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("run_id") == _run_id():
            found.append(record)
    return sorted(found, key=lambda r: r.get("job", 0))


def finish(code: int) -> int:
    """The exit code of a process whose Hydra run ended with `code`: a multirun that had failed jobs names each
    of them (on rank 0) and ends with the first one's code."""
    if _sweep_dir is None or not _sweep_dir.is_dir():
        return code
    failed = _records(_sweep_dir)
    if not failed:
        return code
    from core.distributed.launch import global_rank

    if global_rank() == 0:
        lines = [f"  job {r['job']} ({r['overrides']}): {r['error']}" for r in failed]
        print(
            f"multirun: {len(failed)} job(s) failed (records: {_sweep_dir}/*/{RECORD}):",
            *lines,
            sep="\n",
            file=sys.stderr,
        )
        sys.stderr.flush()
    return int(failed[0]["code"]) or code or 1


def job_error(code: int, label: str, message: str) -> JobFailed:
    """The error that ends a multirun job with `code` and the line `label + message`."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    return JobFailed(code, f"{hydra.job.num} ({_swept(list(hydra.overrides.task))})", label + message)


def _swept(overrides: list[str]) -> str:
    """The overrides a job's sweep varies (`optim.lr=-1`), which tell its jobs apart; all of them if none."""
    from core.distributed.launch import swept_keys

    keys = swept_keys()
    varied = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in keys]
    return " ".join(varied or overrides) or "no overrides"
