"""Loaders over the samplers, and batches moved to the device by a background thread ahead of the compute."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import signal
import threading
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)


def _ignore_signals(signals: tuple[signal.Signals, ...], worker_id: int) -> None:
    # The launcher signals the whole process group; loader workers must survive it so that the main
    # process can finish its step and save (they exit with it).
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def usable_workers(num_workers: int) -> int:
    """`data.num_workers`, at most this rank's share of the CPU cores the process may run on (the local ranks share
    them): more worker processes than cores only take turns. Said once per process, by the first rank."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    share = cores // local_ranks
    if num_workers <= share:
        return num_workers
    _note_fewer_workers(num_workers, cores, local_ranks, share)
    return share


@functools.cache
def _note_fewer_workers(num_workers: int, cores: int, local_ranks: int, share: int) -> None:
    if os.environ.get("RANK", "0") == "0":
        log.info(
            "note: data.num_workers=%d is more than this rank's share of the CPU cores (%d cores, %d local "
            "ranks): %d loader workers per rank",
            num_workers,
            cores,
            local_ranks,
            share,
        )


def make_loader(
    dataset: Dataset,
    batch_sampler: Sampler,
    num_workers: int,
    pin_memory: bool,
    seed: int,
    collate_fn=None,
    ignore_signals: tuple[signal.Signals, ...] = (),
) -> DataLoader:
    num_workers = usable_workers(num_workers)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        worker_init_fn=functools.partial(_ignore_signals, ignore_signals) if ignore_signals else None,
        # Seeds the workers' RNGs from this run's seed rather than the global RNG state.
        generator=torch.Generator().manual_seed(seed),
    )


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# Batches prepared ahead of the one being handed out, besides the one each thread is working on.
PREFETCH_DEPTH = 2


def prefetch_to_device(
    batches: Iterator, device: torch.device, count: int, move=None, threads: int = 1, depth: int = PREFETCH_DEPTH
) -> Iterator:
    """The first `count` batches of `batches`, in order, on `device` (moved by `move(batch, device)`, to_device
    by default; never more than `count` are taken). Background threads take and move them ahead of the one
    handed out (at most `threads` + `depth` batches at a time), so the move runs beside the training step
    instead of between steps. Several threads move several batches at once: a decode on the GPU waits for
    the SMs the step holds (recipes/vit/jpeg.py), one batch is not done by the time the step wants the next.
    On CUDA each thread queues its work on its own stream, and a batch is handed out with the current stream
    made to wait for that work (pinned host memory: asynchronous copies). An error in a thread is raised here,
    at the batch it happened on, after the batches before it."""
    handover = _Handover(batches, count, ahead=threads + depth)
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    workers = [
        threading.Thread(
            target=_move_batches,
            args=(handover, move or to_device, device, index),
            name=f"prefetch_to_device_{i}",
            daemon=True,
        )
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    try:
        for number in itertools.count():
            result = handover.result(number, workers)
            if result is None:
                return  # the end
            if isinstance(result, _Failed):
                raise result.error
            batch, event = result
            if event is not None:
                compute_stream = torch.cuda.current_stream(device)
                compute_stream.wait_event(event)
                _record_stream(batch, compute_stream)  # its memory was allocated on a side stream
            yield batch
    finally:
        handover.stop()
        for worker in workers:
            worker.join(timeout=60)


class _Failed:
    """A batch's place taken by the error that came instead of it (from the source or from the move)."""

    def __init__(self, error: BaseException):
        self.error = error


class _Handover:
    """What the moving threads and the consumer share: the source, taken from by one thread at a time, and
    the results by batch number, which the consumer takes in order whatever order the threads finish in."""

    def __init__(self, batches: Iterator, count: int, ahead: int):
        self._source = enumerate(itertools.islice(batches, count))
        self._ahead = ahead  # batches taken and not yet handed out, at most
        self._taking = threading.Lock()  # one thread at a time takes the next batch from the source
        self._changed = threading.Condition()
        self._done: dict[int, object] = {}  # batch number -> (batch, CUDA event) or _Failed
        self._taken = self._handed = 0
        self._end: int | None = None
        self._stopped = False

    def take(self):
        """The next (number, batch), or None at the end, when the consumer stopped or the source failed."""
        with self._changed:
            while not self._stopped and self._taken - self._handed >= self._ahead:
                self._changed.wait(0.1)
            if self._stopped:
                return None
        with self._taking:
            try:
                item = next(self._source, None)
            except BaseException as e:  # noqa: BLE001 - e.g. a loader worker's error: handed to the consumer
                with self._changed:
                    self._done[self._taken] = _Failed(e)
                    self._taken += 1
                    self._changed.notify_all()
                return None
            with self._changed:
                if item is None:
                    self._end = self._taken if self._end is None else self._end
                    self._changed.notify_all()
                else:
                    self._taken += 1
            return item

    def put(self, number: int, result) -> None:
        with self._changed:
            self._done[number] = result
            self._changed.notify_all()

    def result(self, number: int, workers: list[threading.Thread]):
        """Batch `number`'s result once a thread has put it, or None at the end."""
        with self._changed:
            while number not in self._done and self._end != number:
                if not any(worker.is_alive() for worker in workers):
                    raise RuntimeError(
                        f"prefetch_to_device: every thread ended before batch {number}"
                    )  # not expected: a failure is handed over first
                self._changed.wait(0.1)
            if number not in self._done:
                return None
            self._handed += 1
            self._changed.notify_all()
            return self._done.pop(number)

    def stop(self) -> None:
        """The consumer is done (the end, an error, closed early): threads waiting for room end."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


def _move_batches(handover: _Handover, move, device: torch.device, index: int | None) -> None:
    """One thread's work: take a batch, move it, put the result; until the end, a stop or a failure. On CUDA
    the thread queues its work on a stream of its own."""
    side = None
    if device.type == "cuda":
        torch.cuda.set_device(index)  # the current device is per thread
        side = torch.cuda.Stream(index)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        while (item := handover.take()) is not None:
            number, batch = item
            result = _moved(move, batch, device, side)
            handover.put(number, result)
            if isinstance(result, _Failed):
                return


def _moved(move, batch, device: torch.device, side):
    """(the moved batch, a CUDA event recorded after its work on the side stream, or None), or _Failed."""
    try:
        moved = move(batch, device)
        event = None
        if side is not None:
            event = torch.cuda.Event()
            event.record(side)
        return moved, event
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
        return _Failed(e)


def _record_stream(batch, stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)
