"""One writer per checkpoint path: `<checkpoint.path>/LOCK`, held by the run's rank 0 while it trains.

A second run on the same path stops at start with a message naming the holder (host, pid, job id, since
when). A lock left behind by a run that died is taken over, with a warning, when it is provably stale:
  * its holder ran on this host, in this PID namespace and since the same boot, and that process no longer
    exists (two containers sharing a host name have their own PIDs: there a pid tells nothing, and the
    rules below decide);
  * its holder ran on another host as an earlier attempt of this same cluster job (a SLURM requeue:
    same job and step id);
  * it has not been refreshed for `stale_after_s` (the holder refreshes it every `refresh_s` from a
    background thread, so a live run on another host always looks alive).
A LOCK that is not a lock record (empty, not JSON, another shape) names no holder: it counts as held by an
unknown run until it has not been modified for `stale_after_s`; so does a LOCK that is not a regular file (a FIFO,
a link), read without blocking or following it. A LOCK that is a directory is never taken over: the message
says to remove it.

No starter ever sees a half-written LOCK: the record is written to a private file first and then linked
into place under the name LOCK, which fails if a LOCK exists. Of two starters that judge the same lock
stale, only the one whose rename moves that very file takes it away; the other retries and finds the new
holder. Creating the lock is also the check that `checkpoint.path` is writable, before any work.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.config.file_shape import NotThisKindOfFile, problems, read_small_file_and_stat

log = logging.getLogger("checkpoint")

LOCK_NAME = "LOCK"
ATTEMPTS = 5  # create, or judge and take away a stale lock, then create again
# link() errors of filesystems without hard links: the lock is then created in place (O_EXCL), and readers
# that catch it empty treat it as held by an unknown run.
NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS}
MAX_BYTES = 64 * 1024  # a lock record is some 200 bytes


class LockRecord(BaseModel):
    """What LOCK holds: the run holding the path."""

    model_config = ConfigDict(strict=True, frozen=True)
    host: str
    pid: Annotated[int, Field(ge=1, le=2**31 - 1)]  # what os.kill accepts
    job: Optional[str]
    since: Annotated[float, Field(allow_inf_nan=False)]
    # Where `pid` means a process: the PID namespace (inode of /proc/self/ns/pid) and the boot id of the
    # holder; null where unreadable. A lock written before these fields has neither (`model_fields_set`).
    pidns: Optional[str] = None
    boot: Optional[str] = None


@dataclass(frozen=True)
class LockFile:
    """LOCK as read once: its holder (None: not a lock record, `problem` says why), its bytes, and where and
    when it was written (device, inode, mtime in ns)."""

    holder: Optional[LockRecord]
    problem: Optional[str]
    content: bytes
    written: tuple[int, int, int]
    directory: bool = False  # LOCK is a directory: never taken over (removing it could delete what it holds)

    @property
    def mtime(self) -> float:
        return self.written[2] / 1e9

    def is_same_file(self, other: LockFile) -> bool:
        """The same file, not one created after it (a new file can get a freed inode number)."""
        return (self.written, self.content) == (other.written, other.content)


def _job_id() -> Optional[str]:
    """The cluster job (and step) this process belongs to; a requeued job keeps it."""
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm {os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 'batch')}"
    for var in ("PBS_JOBID", "LSB_JOBID"):
        if var in os.environ:
            return f"{var} {os.environ[var]}"
    return None


def _pid_namespace() -> Optional[str]:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # not Linux, or /proc not mounted
        return None


def _boot_id() -> Optional[str]:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def read_lock(path: Path) -> Optional[LockFile]:
    """LOCK as it is now; None if there is none."""
    try:
        content, status = read_small_file_and_stat(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except NotThisKindOfFile as e:  # a FIFO, a link, a directory, ...: judged by the name's own lstat
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            return None
        return LockFile(
            None,
            str(e),
            b"",
            (status.st_dev, status.st_ino, status.st_mtime_ns),
            directory=stat.S_ISDIR(status.st_mode),
        )
    holder, problem = None, None
    if not content.strip():
        problem = "it is empty"
    else:
        try:
            holder = LockRecord.model_validate_json(content)
        except ValidationError as e:
            problem = problems(e)
    return LockFile(holder, problem, content, (status.st_dev, status.st_ino, status.st_mtime_ns))


class LockHeld(RuntimeError):
    """Another live run writes to this checkpoint path."""


class PathLock:
    def __init__(self, root: Path, refresh_s: float = 30.0, stale_after_s: float = 300.0):
        self.path = Path(root) / LOCK_NAME
        self.refresh_s, self.stale_after_s = refresh_s, stale_after_s
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": _job_id(),
            "pidns": _pid_namespace(),
            "boot": _boot_id(),
        }
        self.since: Optional[float] = None  # when this process created its LOCK
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld naming the holder; OSError if the path cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(ATTEMPTS):
            if self._create():
                self._thread = threading.Thread(target=self._heartbeat, name="checkpoint-lock", daemon=True)
                self._thread.start()
                return
            lock = read_lock(self.path)
            if lock is None:
                continue  # taken away since: try again
            reason = self._stale_reason(lock)
            if reason is None:
                raise LockHeld(self._held_message(lock))
            if self._take_away(lock):
                holder = f" ({_describe(lock)})" if lock.holder is not None else ""
                log.warning("taking over the lock %s: %s%s", self.path, reason, holder)
        raise LockHeld(
            f"could not take the lock {self.path}: other runs keep creating it. If no run uses "
            f"{self.path.parent}, delete {self.path} and start again"
        )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                mine = self._is_mine(read_lock(self.path))
            except OSError:
                mine = False  # cannot tell: leave it (it goes stale)
            if mine:
                self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        """Create LOCK holding this run's record, complete from its first moment; False if a LOCK exists."""
        self.since = time.time()
        record = json.dumps({**self.me, "since": self.since}).encode()
        private = self.path.with_name(f".{LOCK_NAME}.{uuid.uuid4().hex}")
        with open(private, "xb") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        try:
            return self._place(private, record)
        finally:
            private.unlink(missing_ok=True)

    def _place(self, source: Path, content: bytes) -> bool:
        """LOCK becomes `source` (a hard link: atomic, and fails if LOCK exists); False if a LOCK exists."""
        try:
            os.link(source, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
        try:  # no hard links here: create it in place, where a reader may catch it empty for a moment
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask decides, as for any file
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_away(self, judged: LockFile) -> bool:
        """Remove LOCK if it is still the file judged stale. A rename moves it atomically, so of two starters
        only one moves that file; a LOCK created in between is put back. True if the judged file is gone."""
        aside = self.path.with_name(f".{LOCK_NAME}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # another starter took it away first
        try:
            moved = read_lock(aside)
            if moved is not None and moved.is_same_file(judged):
                return True
            if moved is not None and not self._place(aside, moved.content):
                log.warning(
                    "%s: while taking over a stale lock, a lock created meanwhile (%s) was replaced by "
                    "another starter's; that run will warn that it no longer holds the path",
                    self.path,
                    _describe(moved),
                )
            return False
        finally:
            aside.unlink(missing_ok=True)

    def _stale_reason(self, lock: LockFile) -> Optional[str]:
        age = time.time() - lock.mtime
        holder = lock.holder
        if lock.directory:
            return None
        if holder is None:
            if age > self.stale_after_s:
                return f"it is not a lock record ({lock.problem}) and has not been modified for {age:.0f} s"
            return None
        if self._same_processes(holder):
            return None if _process_alive(holder.pid) else "its process no longer runs"
        if holder.job and holder.job == self.me["job"]:
            return "it was held by an earlier attempt of this job"
        if age > self.stale_after_s:
            return f"not refreshed for {age:.0f} s"
        return None

    def _same_processes(self, holder: LockRecord) -> bool:
        """Whether the holder's pid names a process this one can see: the same host, PID namespace and boot.
        A field a lock of an earlier version lacks is not compared."""
        return holder.host == self.me["host"] and all(
            getattr(holder, key) == self.me[key] for key in ("pidns", "boot") if key in holder.model_fields_set
        )

    def _held_message(self, lock: LockFile) -> str:
        if lock.directory:
            return (
                f"{self.path} is a directory, not a lock file: no run creates one, so it names no holder, and "
                f"this run neither takes it over nor deletes what it holds. If no run uses {self.path.parent}, "
                f"look inside, remove it (rm -r {self.path}) and start again; otherwise use another "
                f"checkpoint.path"
            )
        if lock.holder is None:
            left = self.stale_after_s - (time.time() - lock.mtime)
            return (
                f"{self.path} is not a lock record ({lock.problem}), so the run using {self.path.parent} is "
                f"unknown; it is taken over once it has not been modified for {self.stale_after_s:.0f} s "
                f"(in {left:.0f} s). If no run uses {self.path.parent}, delete {self.path}; otherwise use "
                f"another checkpoint.path"
            )
        return (
            f"{self.path.parent} is in use by another run ({_describe(lock)}); two runs on one checkpoint path "
            f"would overwrite each other's checkpoints. Use another checkpoint.path, or, if that run is gone, "
            f"delete {self.path}"
        )

    def _is_mine(self, lock: Optional[LockFile]) -> bool:
        holder = lock.holder if lock is not None else None
        return holder is not None and (holder.host, holder.pid, holder.since) == (
            self.me["host"],
            self.me["pid"],
            self.since,
        )

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(self.refresh_s):
            try:
                lock = read_lock(self.path)
            except OSError:
                continue  # unreadable for now: try again at the next refresh
            if self._is_mine(lock):
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # removed between reading and refreshing: noticed at the next refresh
            elif not warned:
                log.warning(
                    "%s no longer names this run (%s): another run may write checkpoints to %s as well; "
                    "this run goes on, but the two overwrite each other's checkpoints",
                    self.path,
                    "it was removed" if lock is None else f"now: {_describe(lock)}",
                    self.path.parent,
                )
                warned = True


def _describe(lock: LockFile) -> str:
    holder = lock.holder
    if holder is None:
        return "holder unknown"
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.since))
    except (OverflowError, OSError, ValueError):  # a time no calendar date stands for
        since = f"{holder.since:g} s after 1970"
    job = f", job {holder.job}" if holder.job else ""
    return f"host {holder.host}, pid {holder.pid}{job}, since {since}"
