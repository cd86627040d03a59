"""Two starters taking one LOCK at the same moment, TRIALS times, each in its own folder under a root.

The starters are fresh interpreters (spawned, importing only this module and the lock): a process forked from
the test process would inherit whatever locks its other threads (a decoder's thread pool, torch's) held at
that moment, and could hang on one for a reason that has nothing to do with the lock under test."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from core.checkpointing.lock import LockHeld, PathLock, read_lock

TRIALS = 100  # each trial can catch a race; one in ten or more did with the lock of before
WAIT_S = 120  # a stalled disk (the lock fsyncs its record) is slow, not a failure of the lock


def _start_together(me: int, trial: int, ready, go) -> None:
    """Both starters spin until the other is spinning too, so they call acquire within microseconds of
    each other (a barrier alone wakes them too far apart to meet inside the creation of a lock)."""
    deadline = time.monotonic() + WAIT_S
    if me == 0:
        while ready.value != trial:
            if time.monotonic() > deadline:
                raise TimeoutError("the other starter never came")
        go.value = trial
    else:
        ready.value = trial
        while go.value != trial:
            if time.monotonic() > deadline:
                raise TimeoutError("the other starter never came")


def _contend(me: int, root: str, ready, go, both, results) -> None:
    """One starter: in each trial folder, try to take the lock the moment the other starter does; hold it
    until both have tried (so a refusal is not merely the winner having released it already)."""
    for trial in range(TRIALS):
        lock = PathLock(Path(root) / str(trial))
        both.wait(timeout=WAIT_S)
        _start_together(me, trial, ready, go)
        try:
            lock.acquire()
            outcome = "won"
        except LockHeld:
            outcome = "refused"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            outcome = f"{type(e).__name__}: {e}"
        both.wait(timeout=WAIT_S)  # both have tried
        holder = read_lock(lock.path)
        names_me = holder is not None and holder.holder is not None and holder.holder.pid == os.getpid()
        results.put((trial, outcome, names_me))
        both.wait(timeout=WAIT_S)  # both have looked
        lock.release()


def race(root: Path) -> dict[int, list[tuple[str, bool]]]:
    """Each trial's two outcomes: ("won" or "refused" or an error, whether LOCK then named that starter)."""
    context = multiprocessing.get_context("spawn")
    ready, go = context.RawValue("i", -1), context.RawValue("i", -1)
    both, results = context.Barrier(2), context.Queue()
    starters = [
        context.Process(target=_contend, args=(me, str(root), ready, go, both, results), daemon=True) for me in (0, 1)
    ]
    for p in starters:
        p.start()
    outcomes: dict[int, list[tuple[str, bool]]] = {}
    try:
        for _ in range(2 * TRIALS):
            trial, outcome, names_me = results.get(timeout=2 * WAIT_S)
            outcomes.setdefault(trial, []).append((outcome, names_me))
    finally:
        for p in starters:
            p.join(timeout=WAIT_S)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in starters] == [0, 0]
    return outcomes
