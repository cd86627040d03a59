"""Loaders over the samplers, and batches moved to the device by a background thread ahead of the compute."""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import signal
import threading
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def _ignore_signals(signals: tuple[signal.Signals, ...], worker_id: int) -> None:
    # The launcher signals the whole process group; loader workers must survive it so that the main
    # process can finish its step and save (they exit with it).
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def make_loader(dataset: Dataset, batch_sampler: Sampler, num_workers: int, pin_memory: bool, seed: int,
                collate_fn=None, ignore_signals: tuple[signal.Signals, ...] = ()) -> DataLoader:
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


# Batches prepared ahead of the one being trained on: with data.decode_on=device a micro-batch's decode takes
# about as long as a training micro-batch, so one more in the queue absorbs the variation between batches.
PREFETCH_DEPTH = 2
SIDE_STREAM_PRIORITY = 0  # the prefetching thread's CUDA stream (lower: scheduled first)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


def prefetch_to_device(batches: Iterator, device: torch.device, count: int, move=None,
                       depth: int = PREFETCH_DEPTH) -> Iterator:
    """The first `count` batches of `batches`, in order, on `device` (moved by `move(batch, device)`, to_device
    by default; never more than `count` are taken). A background thread takes and moves them up to `depth`
    batches ahead of the one handed out, so the move (for some recipes a decode on the device) runs beside
    the training step instead of between steps. On CUDA the thread queues its work on its own stream, and a
    batch is handed out with the current stream made to wait for that work (pinned host memory: asynchronous
    copies). An error in the thread is raised here, at the batch it happened on."""
    move = move or to_device
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    side = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY) if device.type == "cuda" else None

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            if side is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for batch in itertools.islice(batches, count):
                    moved = move(batch, device)
                    done = None
                    if side is not None:
                        done = torch.cuda.Event()
                        done.record(side)
                    if not put((moved, done)):
                        return
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put(_Failed(e))

    thread = threading.Thread(target=produce, name="prefetch_to_device", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            batch, done = item
            if done is not None:
                compute_stream = torch.cuda.current_stream(device)
                compute_stream.wait_event(done)
                _record_stream(batch, compute_stream)  # its memory was allocated on the side stream
            yield batch
    finally:
        stop.set()
        thread.join(timeout=60)


def _record_stream(batch, stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)
