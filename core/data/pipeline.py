"""A run's data: the training stream split over ranks and micro-batches, and the validation loader.

Step k uses samples [k*G, (k+1)*G) of the shuffled stream (G: the global batch), split over data-parallel
ranks and micro-batches; gradient accumulation makes up the rest of the global batch. The stream depends
only on the samples consumed, so a resumed run, on any number of ranks, continues at the exact next sample.
Loader workers are seeded from the data-parallel rank: tensor-parallel peers must see the same batches.
"""

from __future__ import annotations

import signal
from typing import Iterator

from omegaconf import DictConfig

from core.data.datasets import MultiEpochDatasetResampler
from core.data.loading import PREFETCH_DEPTH, make_loader, prefetch_to_device
from core.data.sampling import EvalBatchSampler, GlobalBatchSampler, PaddedEval
from core.distributed.env import DistEnv
from core.training.device_batches import device_mover
from core.training.length import run_length


class TrainingData:
    def __init__(
        self, recipe, cfg: DictConfig, env: DistEnv, accumulation: int, ignore_signals: tuple[signal.Signals, ...] = ()
    ):
        training = cfg.training
        self.recipe, self.env, self.accumulation, self.ignore_signals = recipe, env, accumulation, ignore_signals
        self.micro_batch_size, self.global_batch_size = training.micro_batch_size, training.global_batch_size
        self.num_workers, self.seed = cfg.data.num_workers, cfg.seed
        self.pin_memory = env.device.type == "cuda" and cfg.data.pin_memory
        datasets = recipe.build_datasets()
        self.train, self.val = datasets.train, datasets.val
        # training.epochs -> steps
        self.length = run_length(training.steps, training.epochs, training.global_batch_size, len(self.train))
        self.val_loader = None
        self.sampler = None  # the training loader's (micro_batches): this rank's stream positions, in order
        if self.val is not None and training.limit_val_batches != 0:
            sampler = EvalBatchSampler(
                len(self.val), training.micro_batch_size, env.dp_size, env.dp_rank, training.limit_val_batches
            )
            self.val_loader = make_loader(
                PaddedEval(self.val),
                sampler,
                self.num_workers,
                self.pin_memory,
                cfg.seed,
                recipe.collate_fn(),
                ignore_signals,
            )

    def start_val_workers(self) -> None:
        """Fork the validation loader's (persistent) workers now, with the training loader's, before the first
        step, instead of at the first validation. During training, gloo's threads finish asynchronous
        collectives (FSDP2's prefetching all-gathers) and take CPython's thread-state lock to release their
        tensors; a process forked at that moment inherits the lock held, and on CPython before 3.11.10
        (python/cpython#112275) the new worker deadlocks as it starts (docs/data.md). Every validation then
        reuses these workers."""
        if self.val_loader is not None and self.num_workers > 0:
            iter(self.val_loader)

    def micro_batches(self, consumed_samples: int, count: int) -> Iterator[dict]:
        """This rank's next `count` micro-batches from stream position `consumed_samples`, on the device; the
        next ones' host-to-device copies (or decoding) overlap the current step (core/data/loading.py)."""
        env = self.env
        sampler = self.sampler = GlobalBatchSampler(
            self.micro_batch_size, self.global_batch_size, env.dp_size, env.dp_rank, consumed_samples
        )
        # The stream reaches from `consumed_samples` to the last sample these micro-batches take, whatever the
        # position: a run resumed with another global batch (checkpoint.allow_config_changes) stands at a count
        # that is no multiple of this one, and may be past training.steps x this batch.
        end = consumed_samples + max(-(-count // self.accumulation), 1) * self.global_batch_size
        stream = MultiEpochDatasetResampler(self.train, num_samples=end, seed=self.seed)
        loader = make_loader(
            stream,
            sampler,
            self.num_workers,
            self.pin_memory,
            self.seed + env.dp_rank,
            self.recipe.collate_fn(),
            self.ignore_signals,
        )
        self.start_val_workers()
        # A step takes all its micro-batches before it starts (their loss counts scale the loss): the threads
        # prepare the next step's while this one trains.
        return prefetch_to_device(
            iter(loader),
            env.device,
            count,
            device_mover(self.recipe, env.context_parallel()),
            threads=self.recipe.prefetch_threads(),
            depth=max(PREFETCH_DEPTH, self.accumulation),
        )
