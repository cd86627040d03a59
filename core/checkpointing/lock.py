"""One writer per checkpoint path: `<checkpoint.path>/LOCK`, held by the run's rank 0 while it trains.

A second run on the same path stops at start with a message naming the holder (host, pid, job id, since
when). A lock left behind by a run that died is taken over, with a warning, when it is provably stale:
  * its holder ran on this host and that process no longer exists;
  * its holder ran on another host as an earlier attempt of this same cluster job (a SLURM requeue:
    same job and step id);
  * it has not been refreshed for `stale_after_s` (the holder refreshes it every `refresh_s` from a
    background thread, so a live run on another host always looks alive).
Creating the lock is also the check that `checkpoint.path` is writable, before any work.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("checkpoint")

LOCK_NAME = "LOCK"


def _job_id() -> Optional[str]:
    """The cluster job (and step) this process belongs to; a requeued job keeps it."""
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm {os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 'batch')}"
    for var in ("PBS_JOBID", "LSB_JOBID"):
        if var in os.environ:
            return f"{var} {os.environ[var]}"
    return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class LockHeld(RuntimeError):
    """Another live run writes to this checkpoint path."""


class PathLock:
    def __init__(self, root: Path, refresh_s: float = 30.0, stale_after_s: float = 300.0):
        self.path = Path(root) / LOCK_NAME
        self.refresh_s, self.stale_after_s = refresh_s, stale_after_s
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld naming the holder; OSError if the path cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock is removed, then created again by whoever gets there first
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                reason = self._stale_reason(holder)
                if reason is None:
                    raise LockHeld(f"{self.path.parent} is in use by another run ({_describe(holder)}); two runs on one "
                                   f"checkpoint path would overwrite each other's checkpoints. Use another "
                                   f"checkpoint.path, or, if that run is gone, delete {self.path}") from None
                log.warning("taking over the lock %s: %s (%s)", self.path, reason, _describe(holder))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({**self.me, "since": time.time()}, f)
            self._thread = threading.Thread(target=self._heartbeat, name="checkpoint-lock", daemon=True)
            self._thread.start()
            return
        raise LockHeld(f"could not take the lock {self.path}: other runs keep creating it")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder = self._read()
            if holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.path.unlink(missing_ok=True)

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text()) | {"mtime": self.path.stat().st_mtime}
        except (OSError, ValueError):
            return {}

    def _stale_reason(self, holder: dict) -> Optional[str]:
        if not holder:
            return "it is unreadable or empty (a run died while creating it)"
        if holder.get("host") == self.me["host"]:
            return None if _process_alive(int(holder.get("pid", -1))) else "its process no longer runs"
        if holder.get("job") and holder.get("job") == self.me["job"]:
            return "it was held by an earlier attempt of this job"
        age = time.time() - holder.get("mtime", 0)
        if age > self.stale_after_s:
            return f"not refreshed for {age:.0f} s"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # removed by hand: the next run will take it


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {since}"
