"""Save-and-stop on a scheduler's signal (SLURM `--signal=USR1@120`, torchrun forwarding SIGTERM).

The handler only records the signal; the loop asks `stop_requested()` at the end of every step, which
all ranks answer together (one tiny all-reduce on a CPU tensor, i.e. over gloo: no GPU sync), so every
rank saves the same step and leaves, even if only one of them got the signal. The same signal a second
time ends the process at once (as it would without the handler), and so does any of them in a process
forked from this one: a save-and-stop request is only ever held by the training process itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def parse_signals(names: list[str]) -> tuple[signal.Signals, ...]:
    """checkpoint.save_on_signals names (checked by its schema) -> signals."""
    return tuple(signal.Signals[str(name).upper()] for name in names)


class StopSignals:
    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._pid = os.getpid()
        if signals and threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: checkpoint.save_on_signals cannot be installed")
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if os.getpid() != self._pid or self.received == name:
            signal.signal(signum, signal.SIG_DFL)  # end as the signal would have without us
            os.kill(os.getpid(), signum)
            return
        self.received = name

    def stop_requested(self, asked: bool = False) -> bool:
        """True on every rank if any rank received a signal, or was `asked` to stop otherwise (a training
        callback: core/training/callbacks.py); a collective: call it on all ranks."""
        flag = torch.tensor([1 if self.received or asked else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
