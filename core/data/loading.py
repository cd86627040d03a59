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
        log.info("note: data.num_workers=%d is more than this rank's share of the CPU cores (%d cores, %d local "
                 "ranks): %d loader workers per rank", num_workers, cores, local_ranks, share)


def make_loader(dataset: Dataset, batch_sampler: Sampler, num_workers: int, pin_memory: bool, seed: int,
                collate_fn=None, ignore_signals: tuple[signal.Signals, ...] = ()) -> DataLoader:
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


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch_to_device(batches: Iterator, device: torch.device, count: int, move=None, threads: int = 1,
                       depth: int = PREFETCH_DEPTH) -> Iterator:
    """The first `count` batches of `batches`, in order, on `device` (moved by `move(batch, device)`, to_device
    by default; never more than `count` are taken). Background threads take and move them ahead of the one
    handed out (at most `threads` + `depth` batches at a time), so the move runs beside the training step
    instead of between steps. Several threads move several batches at once: a decode on the GPU waits for
    the SMs the step holds (recipes/vit/jpeg.py), one batch is not done by the time the step wants the next.
    On CUDA each thread queues its work on its own stream, and a batch is handed out with the current stream
    made to wait for that work (pinned host memory: asynchronous copies). An error in a thread is raised here,
    at the batch it happened on, after the batches before it."""
    move = move or to_device
    source = enumerate(itertools.islice(batches, count))
    taking = threading.Lock()  # one thread at a time takes the next batch from the source
    changed = threading.Condition()
    done: dict[int, object] = {}  # batch number -> (batch, CUDA event) or _Failed
    state = {"taken": 0, "handed": 0, "end": None, "stop": False}
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()

    def take():
        """The next (number, batch), or None at the end or when the consumer stopped."""
        with changed:
            while not state["stop"] and state["taken"] - state["handed"] >= threads + depth:
                changed.wait(0.1)
            if state["stop"]:
                return None
        with taking:
            try:
                item = next(source, None)
            except BaseException as e:  # noqa: BLE001 - e.g. a loader worker's error: handed to the consumer
                with changed:
                    done[state["taken"]] = _Failed(e)
                    state["taken"] += 1
                    changed.notify_all()
                return None
            with changed:
                if item is None:
                    state["end"] = state["taken"] if state["end"] is None else state["end"]
                    changed.notify_all()
                else:
                    state["taken"] += 1
            return item

    def produce() -> None:
        side = None
        if device.type == "cuda":
            torch.cuda.set_device(index)  # the current device is per thread
            side = torch.cuda.Stream(index)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            while (item := take()) is not None:
                number, batch = item
                try:
                    moved = move(batch, device)
                    event = None
                    if side is not None:
                        event = torch.cuda.Event()
                        event.record(side)
                    result = (moved, event)
                except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                    result = _Failed(e)
                with changed:
                    done[number] = result
                    changed.notify_all()
                if isinstance(result, _Failed):
                    return

    workers = [threading.Thread(target=produce, name=f"prefetch_to_device_{i}", daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        for number in itertools.count():
            with changed:
                while number not in done and state["end"] != number:
                    if not any(worker.is_alive() for worker in workers):
                        raise RuntimeError("prefetch_to_device: every thread ended before batch "
                                           f"{number}")  # not expected: a failure is handed over first
                    changed.wait(0.1)
                if number not in done:
                    return  # the end
                result = done.pop(number)
                state["handed"] += 1
                changed.notify_all()
            if isinstance(result, _Failed):
                raise result.error
            batch, event = result
            if event is not None:
                compute_stream = torch.cuda.current_stream(device)
                compute_stream.wait_event(event)
                _record_stream(batch, compute_stream)  # its memory was allocated on a side stream
            yield batch
    finally:
        with changed:
            state["stop"] = True
            changed.notify_all()
        for worker in workers:
            worker.join(timeout=60)


def _record_stream(batch, stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)
