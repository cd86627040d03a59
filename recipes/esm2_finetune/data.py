"""Packed (or padded) rows of labelled sequences: ESM-2's packing (recipes/esm2/packing.py) with labels per item.

A row is ESM-2's pack (tokens, cu_seqlens, the sequences it holds), unmasked, plus
  sequence tasks:  "targets" [max_sequences, K] (regression: standardised; multilabel: 0/1) or [max_sequences]
                   (classification: the class index, IGNORE for an empty slot), and "weights" of the same shape
                   (each item's class weight; multilabel: the positive weight where the label is 1);
  residue task:    "labels" [budget] (the class of each residue token, IGNORE at <cls>/<eos>/padding and at
                   unlabelled residues) and "weights" [budget] (each labelled token's class weight, else 0).
A sequence longer than model.max_seq_length is cropped to a window (its residue labels with it): drawn from
sample_generator(seed, epoch, sequence) in training, as pretraining draws it; its start in validation and
prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from core.data.datasets import epoch_index, sample_generator
from recipes.esm2.masking import IGNORE, Masking
from recipes.esm2.packing import PackedSequences
from recipes.esm2.tokenizer import CLS, EOS, PAD
from recipes.esm2_finetune.config import Task
from recipes.esm2_finetune.labels import LabelledSequences


@dataclass(frozen=True)
class TargetCoding:
    """How labels become a row's targets: the task, the number of outputs K, the regression standardisation and
    the class weights (None: 1)."""

    task: Task
    outputs: int
    mean: Optional[np.ndarray] = None
    std: Optional[np.ndarray] = None
    weights: Optional[np.ndarray] = None


class LabelledPacks(PackedSequences):
    """Item k (an int, or an EpochIndex in training) is pack k of `sequences[indices]` with its labels."""

    def __init__(
        self,
        sequences: LabelledSequences,
        indices: np.ndarray,
        budget: int,
        max_length: int,
        max_sequences: int,
        coding: TargetCoding,
        seed: int,
        shuffle_seed: Optional[int],
        random_crop: bool,
    ):
        super().__init__(sequences, indices, budget, max_length, max_sequences, Masking(), seed, shuffle_seed)
        self.coding, self.random_crop = coding, random_crop
        weights = coding.weights if coding.weights is not None else np.ones(coding.outputs)
        self.class_weights = torch.as_tensor(weights, dtype=torch.float32)

    def fingerprint(self) -> bytes:
        """The sequences in pack order, their labels and the class names (core/data/fingerprint.py): a resume
        notices a changed label file (a class renamed moves the index of every class sorted after it)."""
        store = self.store
        names = "\n".join(store.classes).encode("utf-8", "surrogateescape")
        arrays = (
            self.order,
            self.starts,
            store.residues,
            store.offsets,
            *(() if store.targets is None else (store.targets,)),
        )
        return names + b"\0" + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        epoch, k = epoch_index(index)
        if not 0 <= k < len(self):
            raise IndexError(f"pack {k} of {len(self)}")
        members = self.order[self.starts[k] : self.starts[k + 1]].tolist()
        tokens = torch.full((self.budget,), PAD, dtype=torch.int64)
        offsets, windows = [0], []
        for i in members:
            start, residues = self._window(i, epoch)
            tokens[offsets[-1] + 1 : offsets[-1] + 1 + len(residues)] = torch.from_numpy(residues.astype(np.int64))
            tokens[offsets[-1]], tokens[offsets[-1] + 1 + len(residues)] = CLS, EOS
            windows.append((offsets[-1], start, len(residues)))
            offsets.append(offsets[-1] + len(residues) + 2)
        while offsets[-1] < self.budget:  # the padding, in pieces the attention kernels' bound covers
            offsets.append(min(offsets[-1] + self.max_length, self.budget))
        offsets += [self.budget] * (self.slots + 1 - len(offsets))
        sequences = torch.full((self.max_sequences,), -1, dtype=torch.int64)
        sequences[: len(members)] = torch.tensor(members, dtype=torch.int64)
        item = {"tokens": tokens, "cu_seqlens": torch.tensor(offsets, dtype=torch.int32), "sequences": sequences}
        if self.coding.task is Task.residue_classification:
            return item | self._residue_labels(members, windows)
        return item | self._sequence_targets(members)

    def _window(self, i: int, epoch: int) -> tuple[int, np.ndarray]:
        """(start, residues) of sequence i's window of at most max_length - 2 residues."""
        residues, keep = self.store.sequence(i), self.max_length - 2
        start = 0
        if len(residues) > keep and self.random_crop:
            start = int(
                torch.randint(0, len(residues) - keep + 1, (1,), generator=sample_generator(self.seed, epoch, i))
            )
        return start, residues[start : start + keep]

    def _residue_labels(self, members: list[int], windows: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        labels = torch.full((self.budget,), IGNORE, dtype=torch.int64)
        targets = self.store.targets
        if targets is not None:
            for i, (offset, start, n) in zip(members, windows):
                first = self.store.offsets[i] + start
                codes = torch.from_numpy(targets[first : first + n].astype(np.int64))
                labels[offset + 1 : offset + 1 + n] = torch.where(codes >= 0, codes, IGNORE)
        weights = torch.where(labels >= 0, self.class_weights[labels.clamp(min=0)], 0.0)
        return {"labels": labels, "weights": weights}

    def _sequence_targets(self, members: list[int]) -> dict[str, torch.Tensor]:
        coding, targets, n = self.coding, self.store.targets, len(members)
        if coding.task is Task.classification:
            classes = torch.full((self.max_sequences,), IGNORE, dtype=torch.int64)
            if targets is not None:
                classes[:n] = torch.from_numpy(targets[members])
            weights = torch.where(classes >= 0, self.class_weights[classes.clamp(min=0)], 0.0)
            return {"targets": classes, "weights": weights}
        values = torch.zeros((self.max_sequences, coding.outputs), dtype=torch.float32)
        weights = torch.zeros((self.max_sequences, coding.outputs), dtype=torch.float32)
        weights[:n] = 1.0
        if targets is not None:
            chosen = targets[members]
            if coding.task is Task.regression:
                chosen = (chosen - coding.mean) / coding.std
            values[:n] = torch.from_numpy(np.asarray(chosen, dtype=np.float32))
            if coding.task is Task.multilabel:  # BCE's positive weight: exact as a factor, the label being 0 or 1
                weights[:n] = torch.where(values[:n] > 0.5, self.class_weights, torch.ones(()))
        return {"targets": values, "weights": weights}
