"""Ranks end when their launcher dies.

torchrun restarts or stops its workers; if torchrun itself is killed (kill -9, a node agent gone), its
workers would go on training as orphans, still writing checkpoints. A daemon thread notices that the
process's parent changed and ends the process with an error. The last complete checkpoint is kept; a
save cut short has no completion marker and is never resumed from.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def exit_with_launcher(poll_s: float = 1.0) -> None:
    """Start the watch (once per process) if a launcher that can die before us started this process."""
    if not launched_by_torchrun() or getattr(exit_with_launcher, "started", False):
        return
    exit_with_launcher.started = True
    parent = os.getppid()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                message = (
                    f"rank {os.environ.get('RANK', '?')}: the launcher (pid {parent}) is gone; "
                    "stopping (the last complete checkpoint is kept)"
                )
                log.error(message)
                print(message, file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
