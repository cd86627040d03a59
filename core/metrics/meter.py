"""The throughput meter: step time, data wait, samples and tokens per second per GPU, MFU and peak memory,
averaged over the steps since the last record."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

from core.metrics.hardware import peak_bf16_flops, peak_memory_gib
from core.training.callbacks import Callback


class ThroughputMeter(Callback):
    """Times training steps between two records. What the loop does outside its steps (validation,
    saving) is excluded; `phase` also times parts of a step when `time_phases` is on, synchronising the
    device at each boundary (a little slower: for benchmarks)."""

    def __init__(
        self,
        device: torch.device,
        global_batch_size: int,
        world_size: int,
        tokens_per_sample: Optional[int],
        flops_per_sample: Optional[float],
        time_phases: bool = False,
        ranks_per_sample: int = 1,
    ):
        """`tokens_per_sample` / `flops_per_sample`: the recipe's (None: no tokens/s / no MFU in the record).
        `ranks_per_sample`: how many ranks share the work of each sample (tensor- x context-parallel): the recipe's
        work of a micro-batch counts whole samples, and each of those ranks does its part."""
        self.device, self.global_batch_size, self.world_size = device, global_batch_size, world_size
        self.ranks_per_sample = ranks_per_sample
        self.tokens_per_sample, self.flops_per_sample, self.time_phases = (
            tokens_per_sample,
            flops_per_sample,
            time_phases,
        )
        self.peak_flops = peak_bf16_flops(device)
        self.start_interval()

    def on_train_start(self, run) -> None:
        self.start_interval()  # setup and restore do not count as step time

    def start_interval(self) -> None:
        """Start timing from now (the loop calls it right before its first step)."""
        self.start, self.steps, self.excluded, self.data_wait = time.perf_counter(), 0, 0.0, 0.0
        self.phases: dict[str, float] = {}
        self.work: Optional[torch.Tensor] = None  # [real tokens, FLOPs] of this rank's micro-batches, when counted

    def add_work(self, work: list) -> None:
        """This rank's micro-batches' (real tokens, FLOPs) from the recipe (device tensors: summed without a host
        sync, read at the next record); a list of None changes nothing."""
        counted = [torch.stack([tokens, flops]).double() for tokens, flops in (w for w in work if w is not None)]
        if counted:
            total = torch.stack(counted).sum(0) / self.ranks_per_sample
            self.work = total if self.work is None else self.work + total

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - start

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.excluded += time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.time_phases:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_done(self) -> None:
        self.steps += 1

    def record(self) -> dict[str, float]:
        """The means since the last record (then starts a new interval)."""
        seconds = time.perf_counter() - self.start - self.excluded
        step_time = seconds / self.steps
        samples_per_gpu = self.global_batch_size / step_time / self.world_size
        if self.work is not None:  # counted per micro-batch on this rank: real tokens, not padding
            tokens, flops = (value / seconds for value in self.work.tolist())
        else:
            tokens, flops = (
                None if per_sample is None else samples_per_gpu * per_sample
                for per_sample in (self.tokens_per_sample, self.flops_per_sample)
            )
        record = {
            "step_time": step_time,
            "data_wait": self.data_wait / self.steps,
            "samples_per_sec_per_gpu": samples_per_gpu,
        }
        if tokens is not None:
            record["tokens_per_sec_per_gpu"] = tokens
        if self.peak_flops is not None and flops is not None:
            record["mfu"] = flops / self.peak_flops
        record["peak_mem_gib"] = peak_memory_gib(self.device)
        record |= {f"time_{name}": seconds / self.steps for name, seconds in self.phases.items()}
        self.start_interval()
        return record
