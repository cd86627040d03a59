"""A preprocess run's outputs while it writes them: `<prefix>.tmp-<host>-<pid>.bin/.idx/.json`, renamed to
`<prefix>.*` once whole (the .json last: its presence means the others are whole).

They are removed when the run fails or is stopped by SIGTERM or SIGHUP (then `Interrupted` is raised; a signal
that was ignored, as nohup ignores SIGHUP, stays ignored). What a run killed outright left (SIGKILL, a lost
node) is removed by the next run for the same prefix on the same host, once that run's process is gone; files
of a live process, or of another host (a shared file system), are left alone. Leftovers named
`<prefix>.tmp-<pid>.*`, as earlier versions named them, count as this host's.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

SUFFIXES = (".bin", ".idx", ".json")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived while the outputs were written. Like KeyboardInterrupt, no `except Exception`
    on its way out takes it for a failure of the input."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def temporary_prefix(prefix: Path) -> Path:
    return prefix.with_name(f"{prefix.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def leftovers(prefix: Path) -> dict[int, list[Path]]:
    """`<prefix>.tmp-*` outputs of this host's preprocess runs whose process is gone, by process id."""
    shape = re.compile(re.escape(prefix.name) + r"\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)(?:\.bin|\.idx|\.json)")
    host, gone = socket.gethostname(), {}
    for path in sorted(prefix.parent.glob(glob.escape(prefix.name) + ".tmp-*")):
        match = shape.fullmatch(path.name)
        if not match or match["host"] not in (None, host) or not path.is_file():
            continue
        pid = int(match["pid"])
        if 0 < pid < 2**31 and pid != os.getpid() and not process_alive(pid):
            gone.setdefault(pid, []).append(path)
    return gone


def remove_leftovers(prefix: Path) -> None:
    """Remove what killed runs left for `prefix` (see the module's text), saying so in one line."""
    gone = leftovers(prefix)
    for paths in gone.values():
        for path in paths:
            path.unlink(missing_ok=True)
    if gone:
        log.warning("removed what an interrupted preprocess left (process%s %s gone from this host): %s",
                    "es" if len(gone) > 1 else "", ", ".join(map(str, gone)),
                    ", ".join(str(p) for paths in gone.values() for p in paths))


class StopSignals:
    """SIGTERM and SIGHUP raise Interrupted in the main thread while installed, unless ignored before (nohup's
    SIGHUP stays ignored) or held back: then they wait, and go where they would have gone without us once the
    handlers before ours are back. A flag, not a signal mask: a mask holds a signal back from one thread only, and
    any thread may take a signal for the process."""

    def __init__(self):
        self.previous: dict[signal.Signals, object] = {}
        self.holding, self.raised, self.pending = False, False, None
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers
        for sig in STOP_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is not None and handler != signal.SIG_IGN:  # None: a handler from C, which we cannot put back
                self.previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        if self.holding or self.raised:  # stopping already: a second signal must not cut the removal short
            self.pending = self.pending or (None if self.raised else signum)
            return
        self.raised = True
        raise Interrupted(signum)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.pending is not None:
            signal.raise_signal(self.pending)


@contextlib.contextmanager
def partial_outputs(tmp: Path) -> Iterator[Callable[[Path], None]]:
    """Write `<tmp>.bin/.idx/.json` inside; the function it gives renames them to a prefix's (all three, or none:
    the stop signals are held meanwhile). On leaving, what is left of them is removed, the stop signals held."""
    signals = StopSignals()

    def commit(prefix: Path) -> None:
        signals.holding = True
        for suffix in SUFFIXES:
            os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")

    try:
        yield commit
    finally:
        signals.holding = True
        for suffix in SUFFIXES:
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        signals.restore()
