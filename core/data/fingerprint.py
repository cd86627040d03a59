"""What identifies a training set's samples, so that a resumed run notices when the data under the same settings
changed (files added, removed or renamed; class folders renamed, which relabels every class after them).

The sample stream is a function of the dataset's length and of what each index holds (core/data/sampling.py), so
a resume on a changed training set trains on another order, or on other labels, than the interrupted run would
have. A checkpoint keeps the training set's length and this fingerprint (train_state.dataset_len,
train_state.data_fingerprint); core/checkpointing/changes.py:data_changes compares them on resume.

A dataset opts in with a method `fingerprint() -> bytes` describing its samples in order (an image folder's files
and labels; MNIST's pixels and labels; ESM-2 fine-tuning's sequences and labels); wrappers that keep the samples in
order (`.dataset`) are looked through. A dataset without one (synthetic data, whose settings say all; GPT's and
ESM-2 pretraining's, whose stores are large) is compared by its length only, and a changed length is a warning.
"""

from __future__ import annotations

import hashlib
from typing import Any

# train_state values are whole numbers below 2**62 (core/training/state.py); 0 means "not recorded".
_BITS = 62


def data_fingerprint(dataset: Any) -> int:
    """A number in [1, 2**62) from `dataset.fingerprint()` (or that of the dataset it wraps); 0: it has none."""
    seen = 0
    while not hasattr(dataset, "fingerprint") and hasattr(dataset, "dataset") and seen < 16:
        dataset, seen = dataset.dataset, seen + 1
    describe = getattr(dataset, "fingerprint", None)
    if not callable(describe):
        return 0
    digest = hashlib.blake2b(describe(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % ((1 << _BITS) - 1) + 1
