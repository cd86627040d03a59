"""Samplers that split the global sample stream over data-parallel ranks.

Training: the stream is epoch 0's permutation of the dataset, then epoch 1's, ... (each seeded by
(seed, epoch); see core.data.datasets.MultiEpochDatasetResampler). Optimizer step k consumes stream
positions [k*G, (k+1)*G) for global batch size G, laid out as [micro-batch][data-parallel rank][sample].
The position depends only on the number of samples consumed, not on the number of ranks, so a run can
continue on another world size.

Validation: every sample exactly once over all ranks; ranks whose share is shorter get padding
samples marked `valid = False`, so all ranks run the same number of forward passes (FSDP
collectives) and padding never reaches the metrics.
"""

from __future__ import annotations

import math
from typing import Iterator

from torch.utils.data import Dataset, Sampler

from core.config.errors import ConfigError


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of positions in the global sample stream, forever, from
    `consumed_samples`. The training dataset (a core.data.datasets.MultiEpochDatasetResampler) turns a
    position into a sample: epoch position // len, the epoch's shuffled order, index-seeded effects."""

    def __init__(
        self, micro_batch_size: int, global_batch_size: int, dp_size: int, dp_rank: int, consumed_samples: int = 0
    ):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global_batch_size must be a multiple of micro_batch_size x data-parallel size")
        self.mb, self.gb, self.dp, self.rank = micro_batch_size, global_batch_size, dp_size, dp_rank
        self.consumed = consumed_samples

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed
        while True:
            for micro in range(self.gb // (self.mb * self.dp)):
                start = position + (micro * self.dp + self.rank) * self.mb
                yield list(range(start, start + self.mb))
            position += self.gb


class PaddedEval(Dataset):
    """Adds "valid": True to each dict sample; index -1 is a padding sample (valid False)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        sample = dict(self.dataset[max(index, 0)])
        sample["valid"] = index >= 0
        return sample


class EvalBatchSampler(Sampler[list[int]]):
    """Rank r takes samples r, r + dp, r + 2 dp, ...; short shares are padded with -1."""

    def __init__(self, dataset_len: int, batch_size: int, dp_size: int, dp_rank: int, limit_batches: int = -1):
        per_rank = math.ceil(dataset_len / dp_size)
        indices = list(range(dp_rank, dataset_len, dp_size))
        indices += [-1] * (per_rank - len(indices))
        self.batches = [indices[i : i + batch_size] for i in range(0, per_rank, batch_size)]
        if limit_batches >= 0:
            self.batches = self.batches[:limit_batches]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per optimizer step on each rank; a clear error when the sizes don't divide."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} is not divisible by training.micro_batch_size="
            f"{micro_batch_size} x data-parallel size {dp_size} = {per_step}"
        )
    return global_batch_size // per_step
