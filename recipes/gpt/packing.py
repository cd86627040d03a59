"""Documents packed into one row of the GPT recipe, with document masks: where each document of a row starts.

A row of `budget` tokens holds documents one after another, then padding. `cu_seqlens` ([slots + 1], int32;
first 0, last budget) gives where each one starts, so attention stays within a document and its rotary positions
restart (TE's "thd" layout, ESM-2's convention: recipes/esm2/packing.py). The padding after the last document is
a piece of its own, and unused slots repeat the last offset (empty documents): every row has the same shapes,
which CUDA graphs need. slots = data.max_documents_per_sample + 1 (the +1 for the padding piece).

Pretraining (`eod_document_lengths`) splits a Megatron sample after each end-of-document token, as Megatron's
reset_attention_mask / reset_position_ids do; a sample of more documents than a row has slots for keeps the first
ones apart and lets the last ones share the final span (attention then crosses their boundaries, as it does
without packing), which the caller counts and logs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def row_offsets(lengths: Sequence[int], budget: int, slots: int) -> np.ndarray:
    """cu_seqlens [slots + 1] (int32) of documents of `lengths` tokens laid out from 0, then the padding
    (budget - their sum) as one piece, then empty slots. ValueError when they do not fit: more documents than
    slots - 1 (one slot is the padding's), or more tokens than the budget."""
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths {lengths}: expected each >= 0")
    if len(lengths) + 1 > slots:
        raise ValueError(f"{len(lengths)} documents and the padding need {len(lengths) + 1} slots; a row has {slots}")
    total = sum(lengths)
    if total > budget:
        raise ValueError(f"documents of {total} tokens do not fit a row of {budget}")
    offsets = np.full(slots + 1, budget, dtype=np.int64)
    offsets[0] = 0
    offsets[1 : len(lengths) + 1] = np.cumsum(lengths)
    # offsets[len(lengths) + 1] onwards stay `budget`: the padding's piece, then the empty slots
    return offsets.astype(np.int32)


def eod_document_count(tokens: np.ndarray, eod: int) -> int:
    """How many documents `tokens` holds: one more than its end-of-document tokens before the last position
    (an end-of-document token last ends the final document; none starts after it)."""
    tokens = np.asarray(tokens)
    if len(tokens) == 0:
        return 0
    return int(np.count_nonzero(tokens[:-1] == eod)) + 1


def eod_document_lengths(tokens: np.ndarray, eod: int, max_documents: int) -> list[int]:
    """The lengths of the documents of `tokens` (a Megatron sample's input tokens), each ending after an
    end-of-document token (it belongs to the document it ends); they sum to len(tokens). More than
    `max_documents` documents: the last ones share the final document's span (eod_document_count tells)."""
    if max_documents < 1:
        raise ValueError(f"max_documents={max_documents}: expected >= 1")
    tokens = np.asarray(tokens)
    if len(tokens) == 0:
        return []
    ends = np.flatnonzero(tokens[:-1] == eod) + 1  # where each document after the first starts
    ends = ends[: max_documents - 1]
    bounds = np.concatenate(([0], ends, [len(tokens)]))
    return np.diff(bounds).tolist()
