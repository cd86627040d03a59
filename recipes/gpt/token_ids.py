"""Token ids as read from a .bin, refused by name where one is negative or beyond the vocabulary.

A .bin of the right size passes every check of its .idx, yet may hold ids the tokenizer never gives (made with
another tokenizer without our .json, or damaged): the embedding then fails without naming the file (an
IndexError on a CPU, a device-side assert on a GPU) or, below the padded vocabulary, trains unused rows. Each
read is checked as it happens, the largest id of the few thousand tokens read (microseconds a sample), so a
file of any size costs nothing at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split

from core.config.errors import DataError


@dataclass
class CheckedGPTDatasetConfig(GPTDatasetConfig):
    source: str = "data.prefixes"  # the setting that gave the files, in errors


class VocabularyChecked:
    """An IndexedDataset (Megatron-Core's reader of a .bin/.idx pair) whose reads refuse ids of `vocab_size` or
    more or below 0; everything else is the reader's own."""

    def __init__(self, indexed, vocab_size: int, tokenizer: str, source: str):
        self.indexed, self.vocab_size, self.tokenizer, self.source = indexed, vocab_size, tokenizer, source

    def __getattr__(self, name: str):
        if name == "indexed":  # not set yet (while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.indexed, name)

    def __len__(self) -> int:
        return len(self.indexed)

    def __getitem__(self, idx):
        return self.get(idx) if isinstance(idx, (int, np.integer)) else self.indexed[idx]

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        ids = self.indexed.get(idx, offset, length)
        # A signed token type (from elsewhere) can hold negative ids: as far outside the vocabulary as large ones.
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            position = int(np.argmax((ids >= self.vocab_size) | (ids < 0)))
            raise DataError(
                f"{self.source}: {self.indexed.path_prefix}.bin: document {int(idx)} holds the token id "
                f"{int(ids[position])} at position {offset + position}, outside the vocabulary of "
                f"data.tokenizer={self.tokenizer} ({self.vocab_size} ids): the files were made with "
                "another tokenizer, or are damaged; give that tokenizer, or preprocess the text again"
            )
        return ids


class CheckedGPTDataset(GPTDataset):
    """Megatron-Core's GPTDataset over VocabularyChecked readers (config: a CheckedGPTDatasetConfig)."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: CheckedGPTDatasetConfig) -> VocabularyChecked:
        indexed = GPTDataset.build_low_level_dataset(dataset_path, config)
        tokenizer = config.tokenizer
        return VocabularyChecked(indexed, tokenizer.vocab_size, tokenizer.name, config.source)

    def _build_document_sample_shuffle_indices(self):
        self._check_one_sample()
        return super()._build_document_sample_shuffle_indices()

    def _check_one_sample(self) -> None:
        """A training or validation split must hold at least one sample's tokens. Megatron-Core would otherwise make
        each training sample of the split's tokens repeated over as many epochs as it takes (for a seq_length far
        above the corpus, building those epochs' indices hangs and exhausts memory), and a validation split would
        have no sample at all, leaving the run without validation without a word. (The test split is only read by
        predict.py, which says so itself.)"""
        if self.index_split not in (Split.train, Split.valid):
            return
        tokens = self._get_num_tokens_per_epoch()
        needed = self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        if tokens < needed:
            split = "training" if self.index_split == Split.train else "validation"
            raise DataError(
                f"model.seq_length={self.config.sequence_length}: the {split} split of {self.config.source} "
                f"({self.dataset.path_prefix}) holds {tokens} tokens, fewer than one sample's {needed} "
                f"(seq_length + 1): give model.seq_length={max(tokens - 1, 1)} or less, or more data (data.split: "
                "the splits' shares)"
            )
