"""Loaders over the samplers, and batches moved to the device one step ahead of the compute."""

from __future__ import annotations

import functools
import itertools
import signal
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


def prefetch_to_device(batches: Iterator, device: torch.device, count: int, move=None) -> Iterator:
    """The first `count` batches of `batches`, on `device` (moved by `move(batch, device)`, to_device by
    default), one fetched ahead (never more than `count` are taken). On CUDA the next batch's move is
    started on a side stream before the current batch is handed out, so it overlaps the current step's
    compute instead of waiting behind it on the compute stream (pinned host memory: asynchronous copies)."""
    batches = itertools.islice(batches, count)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    move = move or to_device

    def start_copy(batch):
        if batch is None:
            return None
        if copy_stream is None:
            return move(batch, device)
        with torch.cuda.stream(copy_stream):
            return move(batch, device)

    ahead = start_copy(next(batches, None))
    while ahead is not None:
        batch = ahead
        if copy_stream is not None:
            compute_stream = torch.cuda.current_stream(device)
            compute_stream.wait_stream(copy_stream)
            _record_stream(batch, compute_stream)  # its memory was allocated on the copy stream
        ahead = start_copy(next(batches, None))
        yield batch


def _record_stream(batch, stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)
