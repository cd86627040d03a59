"""Sequences packed into fixed-size micro-batch rows, so that no compute goes to padding and every step has
the same shapes (what CUDA graphs and FP8 need).

A pack is `budget` tokens holding whole (cropped) sequences one after another, then padding; `cu_seqlens`
([slots + 1], int32) gives where each sequence starts, so attention stays within it and its positions
restart (TE's "thd" layout). The padding after the last sequence is cut into pieces of at most `max_length`
tokens, each one more sequence of its own, and unused slots repeat the last offset (empty sequences): the
longest sequence is then always <= max_length, and the slot count is fixed.

With `multiple` > 1 (data.pad_sequences_to_multiple_of; 2 x distributed.cp for context parallelism, whose ranks
each take 2 equal chunks of every sequence) each sequence's slot is padded to a multiple of it: "cu_seqlens" are
then the padded offsets and "seqlens" [slots] the real tokens of each slot (TE's cu_seqlens_padded and
cu_seqlens); padding tokens are <pad> with no label, and no real token attends to them.

Which sequences share a pack is planned once per dataset (core/data/pack_planning.py: a seeded shuffle, then
each pack filled in that order until the next sequence does not fit), so a pack is a sample like any other: the loop's
sampler shuffles packs per epoch, splits them over ranks and resumes mid-epoch exactly, while each sequence's
window and masks still change per epoch (recipes/esm2/masking.py). Padded batches are the special case of one
sequence per pack and budget = max_length.

Planning holds the shuffled order (8 bytes a sequence, shuffled in place) and the packs' starts; lengths are
looked up and packs filled a chunk of PLAN_CHUNK sequences at a time, so no other array or list of the whole
dataset exists at once (UniRef90 is 150M+ sequences, planned in every process).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from core.config.errors import DataError
from core.data.datasets import epoch_index, sample_generator
from core.data.pack_planning import PLAN_CHUNK, PackPlanner
from recipes.esm2.masking import IGNORE, Masking, crop_and_mask, framed_length
from recipes.esm2.sequences import SequenceStore
from recipes.esm2.tokenizer import PAD, VOCABULARY


class PackedSequences(Dataset):
    """Packs of the store's sequences `indices`: item k (an int, or an EpochIndex for the epoch's random
    windows and masks) is a dict of "tokens" and "labels" [budget] (int64), "cu_seqlens" [slots + 1] (int32) and
    "sequences" [max_sequences] (the store indices of its sequences, -1 for none); with `multiple` > 1 also
    "seqlens" [slots] (int32)."""

    def __init__(
        self,
        store: SequenceStore,
        indices: np.ndarray,
        budget: int,
        max_length: int,
        max_sequences: int,
        masking: Masking,
        seed: int,
        shuffle_seed: int | None,
        multiple: int = 1,
    ):
        if max_length < 3 or budget < max_length:
            raise ValueError(f"budget={budget}, max_length={max_length}: expected 3 <= max_length <= budget")
        if budget % multiple or max_length % multiple:
            raise ValueError(f"budget={budget}, max_length={max_length}: expected multiples of {multiple}")
        self.multiple = multiple
        self.store, self.masking, self.seed = store, masking, seed
        self.budget, self.max_length, self.max_sequences = budget, max_length, max_sequences
        self.slots = max_sequences + math.ceil(budget / max_length)  # + the padding's pieces
        order = np.array(indices, dtype=np.int64)  # a copy: shuffled in place
        if shuffle_seed is not None:
            # The same order as order[rng.permutation(n)]: the same swaps, without an index array of n.
            np.random.default_rng(shuffle_seed).shuffle(order)
        planner, self.real_tokens = PackPlanner(budget, max_sequences), 0
        for start in range(0, len(order), PLAN_CHUNK):
            lengths = framed_length(store.lengths_of(order[start : start + PLAN_CHUNK]), max_length)
            planner.add(-(-lengths // multiple) * multiple)  # the slots they take
            self.real_tokens += int(lengths.sum())
        self.order, self.starts = order, planner.finish()

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        epoch, k = epoch_index(index)
        if not 0 <= k < len(self):
            raise IndexError(f"pack {k} of {len(self)}")
        members = self.order[self.starts[k] : self.starts[k + 1]]
        tokens = torch.full((self.budget,), PAD, dtype=torch.int64)
        labels = torch.full((self.budget,), IGNORE, dtype=torch.int64)
        offsets, real = [0], []
        for i in members.tolist():
            residues = self.store.sequence(i)
            if len(residues) and int(residues.max()) >= len(VOCABULARY):
                raise DataError(
                    f"{self.store.source}: sequence {i} holds token id {int(residues.max())}, outside "
                    f"the {len(VOCABULARY)}-token vocabulary"
                )
            t, y = crop_and_mask(residues, self.max_length, self.masking, sample_generator(self.seed, epoch, i))
            start = offsets[-1]
            tokens[start : start + len(t)], labels[start : start + len(t)] = t, y
            offsets.append(start + -(-len(t) // self.multiple) * self.multiple)
            real.append(len(t))
        while offsets[-1] < self.budget:  # the padding, in pieces the attention kernels' bound covers
            offsets.append(min(offsets[-1] + self.max_length, self.budget))
            real.append(offsets[-1] - offsets[-2])
        offsets += [self.budget] * (self.slots + 1 - len(offsets))
        real += [0] * (self.slots - len(real))
        sequences = torch.full((self.max_sequences,), -1, dtype=torch.int64)
        sequences[: len(members)] = torch.from_numpy(members)
        pack = {
            "tokens": tokens,
            "labels": labels,
            "cu_seqlens": torch.tensor(offsets, dtype=torch.int32),
            "sequences": sequences,
        }
        if self.multiple > 1:
            pack["seqlens"] = torch.tensor(real, dtype=torch.int32)
        return pack
