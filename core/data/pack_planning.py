"""Which variable-length items share a fixed-size pack (a row of `budget` tokens), planned once per dataset.

The rule: items in the order given (the caller shuffles it, seeded), each pack filled until the next item does not
fit in what is left of its budget, or the pack holds max_sequences. A pack is then a sample like any other: the
loop's sampler shuffles packs per epoch, splits them over ranks and resumes mid-epoch exactly. Used by ESM-2's
packed sequences (recipes/esm2/packing.py) and the GPT recipe's packed chat rows (recipes/gpt/sft_data.py).

Planning holds the packs' starts; lengths are fed and packs filled a chunk of PLAN_CHUNK items at a time, so a
caller need not hold any other array or list of the whole dataset at once (UniRef90 is 150M+ sequences, planned in
every process).
"""

from __future__ import annotations

import array

import numpy as np

PLAN_CHUNK = 1 << 16


class PackPlanner:
    """Pack boundaries for sequences fed in order, a chunk of lengths (tokens, each <= budget) at a time. A pack
    closes when the next sequence does not fit in what is left of its budget, or when it holds max_sequences."""

    def __init__(self, budget: int, max_sequences: int):
        self.budget, self.max_sequences = budget, max_sequences
        self.starts, self.seen, self.used, self.count = array.array("q", [0]), 0, 0, 0

    def add(self, lengths: np.ndarray) -> None:
        budget, max_sequences, starts = self.budget, self.max_sequences, self.starts
        used, count = self.used, self.count
        for i, n in enumerate(lengths.tolist(), self.seen):
            if used + n > budget or count == max_sequences:
                starts.append(i)
                used, count = 0, 0
            used += n
            count += 1
        self.seen += len(lengths)
        self.used, self.count = used, count

    def finish(self) -> np.ndarray:
        """starts: pack k holds positions starts[k]:starts[k+1]."""
        self.starts.append(self.seen)
        return np.frombuffer(self.starts, dtype=np.int64)  # a view: no second copy of every start


def plan_packs(lengths: np.ndarray, budget: int, max_sequences: int) -> np.ndarray:
    """Pack boundaries for sequences of `lengths` tokens (in the order given, each <= budget): pack k holds
    positions starts[k]:starts[k+1] (PackPlanner's rule)."""
    planner = PackPlanner(budget, max_sequences)
    for start in range(0, len(lengths), PLAN_CHUNK):
        planner.add(lengths[start : start + PLAN_CHUNK])
    return planner.finish()
