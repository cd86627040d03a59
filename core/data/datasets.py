"""Megatron-compatible dataset utilities: `dataset[i]` is the same sample every time, on every rank.

Random effects (augmentation, masking) must come from the index and the epoch, never from the global
RNGs, so that tensor-parallel ranks see the same inputs and a resumed run sees what the interrupted
run would have seen. The names follow BioNeMo's utilities of the same purpose:

  EpochIndex                          (epoch, idx): what an epoch-aware dataset is indexed with
  IdentityMultiEpochDatasetWrapper    lets an int-indexed dataset take EpochIndex
  MultiEpochDatasetResampler          i -> EpochIndex(epoch, shuffled idx), reshuffled per epoch from (seed, epoch)
  PRNGResampleDataset                 i -> a pseudo-random index of the wrapped dataset (with replacement)
  sample_generator(seed, epoch, idx)  a torch.Generator for one sample's random effects
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import Dataset


class EpochIndex(NamedTuple):
    epoch: int
    idx: int


def mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence: no global state touched)."""
    return (
        int(np.random.SeedSequence([int(v) & 0xFFFFFFFFFFFFFFFF for v in values]).generate_state(1, np.uint64)[0]) >> 1
    )


def sample_generator(seed: int, epoch: int, index: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The random source for one sample in one epoch: the same on every call, rank and worker."""
    return torch.Generator(device).manual_seed(mix_seed(seed, epoch, index))


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The order of `n` samples in `epoch`, from (seed, epoch) only."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def epoch_index(index: Any) -> EpochIndex:
    """Accept an EpochIndex or a plain int (epoch 0)."""
    if isinstance(index, EpochIndex):
        return index
    if isinstance(index, (tuple, list)) and len(index) == 2:
        return EpochIndex(int(index[0]), int(index[1]))
    return EpochIndex(0, int(index))


class IdentityMultiEpochDatasetWrapper(Dataset):
    """An int-indexed dataset that also takes EpochIndex (and ignores the epoch)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: EpochIndex | int) -> Any:
        return self.dataset[epoch_index(index).idx]


class MultiEpochDatasetResampler(Dataset):
    """A map-style dataset of `num_samples` (or `num_epochs` x len) samples over `dataset`.

    Position i belongs to epoch i // len(dataset); within an epoch every index of `dataset` appears
    exactly once, in an order drawn from (seed, epoch) when `shuffle`. The wrapped dataset receives
    EpochIndex(epoch, idx), so it can vary its random effects per epoch (wrap an int-indexed dataset
    in IdentityMultiEpochDatasetWrapper).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_epochs: Optional[int] = None,
        num_samples: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 42,
    ):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.n = len(dataset)
        if self.n == 0:
            raise ValueError("MultiEpochDatasetResampler: the wrapped dataset is empty")
        if num_epochs is not None and num_samples is not None:
            raise ValueError("give num_epochs or num_samples, not both")
        if num_samples is None:
            num_epochs = 1 if num_epochs is None else num_epochs
            if num_epochs < 1:
                raise ValueError(f"num_epochs={num_epochs}: expected >= 1")
            num_samples = num_epochs * self.n
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: expected >= 1")
        self.num_samples = num_samples
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.num_samples

    def epoch_index(self, i: int) -> EpochIndex:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        epoch, offset = divmod(i, self.n)
        if not self.shuffle:
            return EpochIndex(epoch, offset)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, epoch_permutation(self.n, self.seed, epoch)
        return EpochIndex(epoch, self._perm[offset])

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.epoch_index(i)]


class PRNGResampleDataset(Dataset):
    """`num_samples` (default len(dataset)) pseudo-random indices of `dataset`, from `seed` alone, with no
    state: any id can be asked in any order (as in the BioNeMo MNIST tutorial's shuffling of train,
    validation and test sets).

    replacement=True (BioNeMo's behaviour): id i maps to an index drawn from (seed, i), so indices repeat.
    replacement=False: a seeded shuffle; ids [k*n, (k+1)*n) are the k-th permutation of the n indices,
    so every sample appears once per n ids. Given an EpochIndex, it passes one on (the wrapped dataset
    must then take EpochIndex)."""

    def __init__(self, dataset: Dataset, seed: int = 42, num_samples: Optional[int] = None, replacement: bool = True):
        self.dataset, self.seed, self.replacement = dataset, seed, replacement
        self.n = len(dataset)
        if self.n == 0:
            raise ValueError("PRNGResampleDataset: the wrapped dataset is empty")
        self.num_samples = self.n if num_samples is None else num_samples
        self._block, self._perm = -1, None

    def __len__(self) -> int:
        return self.num_samples

    def source_index(self, i: int) -> int:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        if self.replacement:
            return mix_seed(self.seed, i) % self.n
        block, offset = divmod(i, self.n)
        if block != self._block:
            g = torch.Generator().manual_seed(mix_seed(self.seed, block))
            self._block, self._perm = block, torch.randperm(self.n, generator=g).tolist()
        return self._perm[offset]

    def __getitem__(self, index: EpochIndex | int) -> Any:
        if isinstance(index, EpochIndex):  # keep the epoch for an epoch-aware wrapped dataset
            return self.dataset[EpochIndex(index.epoch, self.source_index(index.idx))]
        return self.dataset[self.source_index(int(index))]
