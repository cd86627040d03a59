"""Outputs written under a temporary name tagged with their writer, renamed when whole, removed on a failure or a
stop signal; what a killed writer left is removed by a later run once that writer provably ended.

A pid names a process only on its host, in its PID namespace and since its boot, so a writer is tagged with all
four (`Writer`; the namespace and boot id where /proc tells them), in the temporary name (`name_tag`) or in a
record beside its files (ESM-2's writer.json). `writer_is_gone` judges a writer ended only
where this process can tell: this host, this PID namespace, and no such process or a reboot since. Another host's
writer (a shared file system) or another container's counts as live, and its files are never removed.

The recipes say which files they write and what the final rename is: `tagged_name` names a temporary output,
`ended_leftovers` finds those of ended writers. While a command writes, `RaisingStopSignals` turns SIGTERM and
SIGHUP into `Stopped`, so its partial output goes on the way out as on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

BOOT_ID_CHARS = 8  # a boot id's first group (32 random bits): what a name carries of it, and all that is compared


class Writer(BaseModel):
    """The process writing an output. A tag of an earlier version, read from a name, lacks fields (the pid alone
    was this host's); a field it does not record is not compared (`model_fields_set`). None: unreadable."""

    model_config = ConfigDict(strict=True, frozen=True)
    pid: Annotated[int, Field(ge=1, le=2**31 - 1)]  # what os.kill accepts
    host: Optional[str] = None
    pidns: Optional[str] = None  # the inode of /proc/self/ns/pid
    boot: Optional[str] = None  # /proc/sys/kernel/random/boot_id


def this_writer() -> Writer:
    return Writer(
        pid=os.getpid(),
        host=_host_name(),
        pidns=_read_proc(lambda: str(os.stat("/proc/self/ns/pid").st_ino)),
        boot=_read_proc(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None),
    )


def _host_name() -> str:
    """This host's name as a file name can carry it."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def _read_proc(read) -> Optional[str]:
    try:
        return read()
    except OSError:  # not Linux, or /proc not mounted
        return None


def writer_is_gone(writer: Writer, me: Writer) -> bool:
    """Whether `writer`'s process has provably ended, as `me` (`this_writer()`) sees it; False where it cannot tell
    (another host or PID namespace, a boot id unreadable on one side, a live process of any user)."""
    recorded = writer.model_fields_set
    if any(getattr(writer, key) != getattr(me, key) for key in ("host", "pidns") if key in recorded):
        return False
    if "boot" in recorded and _short(writer.boot) != _short(me.boot):
        return writer.boot is not None and me.boot is not None  # this host rebooted since
    return not process_alive(writer.pid)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _short(boot: Optional[str]) -> Optional[str]:
    return boot[:BOOT_ID_CHARS] if boot else None


def name_tag(writer: Writer) -> str:
    """`<host>-<pid>-ns<pid namespace>-boot<boot id's first group>` (a field unreadable: empty)."""
    return f"{writer.host}-{writer.pid}-ns{writer.pidns or ''}-boot{_short(writer.boot) or ''}"


TAG_SHAPES = (
    re.compile(r"(?P<host>.+)-(?P<pid>[0-9]{1,10})-ns(?P<pidns>[0-9]*)-boot(?P<boot>[0-9a-f]*)"),
    re.compile(r"(?P<host>.+)-(?P<pid>[0-9]{1,10})"),  # earlier versions: host and pid
    re.compile(r"(?P<pid>[0-9]{1,10})"),
)  # earlier still: the pid, of this host


def parse_tag(text: str) -> Optional[Writer]:
    """The writer a name's tag (`name_tag`, or an earlier version's) records; None if `text` is not a tag."""
    for shape in TAG_SHAPES:
        match = shape.fullmatch(text)
        if match:
            fields = {key: value or None for key, value in match.groupdict().items() if key != "pid"}
            try:
                return Writer(pid=int(match["pid"]), **fields)
            except ValidationError:  # a pid os.kill does not take
                return None
    return None


def tagged_name(path: Path, marker: str) -> Path:
    """`<path><marker><this process's tag>`, beside `path`: where this process writes it."""
    return path.with_name(f"{path.name}{marker}{name_tag(this_writer())}")


def ended_leftovers(path: Path, marker: str, suffixes: tuple[str, ...] = ("",)) -> list[tuple[Path, Writer]]:
    """The entries beside `path` named `<path><marker><tag><one of suffixes>` whose writer provably ended, by
    name. The folder beside `path` must exist."""
    me, start, found = this_writer(), path.name + marker, []
    for entry in sorted(path.parent.iterdir()):
        if not entry.name.startswith(start):
            continue
        rest = entry.name[len(start) :]
        writer = next(filter(None, (parse_tag(rest.removesuffix(s)) for s in suffixes if rest.endswith(s))), None)
        if writer is not None and writer_is_gone(writer, me):
            found.append((entry, writer))
    return found


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived while an output was written. Like KeyboardInterrupt, no `except Exception` on its
    way out takes it for a failure of the input."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def stop_signal(stop: BaseException) -> signal.Signals:
    """The signal that raised `stop` (Stopped, or KeyboardInterrupt: SIGINT); a command exits with 128 + it."""
    return signal.Signals(stop.signum if isinstance(stop, Stopped) else signal.SIGINT)


class RaisingStopSignals:
    """SIGTERM and SIGHUP raise Stopped in the main thread from creation until `restore()`, unless ignored before
    (nohup's SIGHUP stays ignored) or held (`hold()`: a rename or removal that must not be cut short): then they
    wait, and go where they would have gone without this once the handlers before are back. A flag, not a signal
    mask: a mask holds a signal back from one thread only, and any thread may take a signal for the process.
    SIGINT keeps Python's KeyboardInterrupt."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.previous: dict[signal.Signals, object] = {}
        self.holding, self.raised, self.pending = False, False, None
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers
        for sig in self.SIGNALS:
            handler = signal.getsignal(sig)
            if handler is not None and handler != signal.SIG_IGN:  # None: a handler from C, which we cannot put back
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.holding or self.raised:  # stopping already: a second signal must not cut the removal short
            self.pending = self.pending or (None if self.raised else signum)
            return
        self.raised = True
        raise Stopped(signum)

    def hold(self) -> None:
        self.holding = True

    def restore(self) -> None:
        """Put the handlers before back; a signal held meanwhile then goes where it would have gone."""
        self.holding = True
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        if self.pending is not None:
            signal.raise_signal(self.pending)
