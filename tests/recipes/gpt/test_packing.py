"""Document offsets of a packed GPT row (recipes/gpt/packing.py): row_offsets' layout and refusals, and the
documents of a pretraining sample split after each end-of-document token."""

from __future__ import annotations

import numpy as np
import pytest

from recipes.gpt.packing import eod_document_count, eod_document_lengths, row_offsets


def test_row_offsets_documents_then_padding_then_empty_slots():
    offsets = row_offsets([3, 5, 2], budget=16, slots=6)
    assert offsets.dtype == np.int32
    assert offsets.tolist() == [0, 3, 8, 10, 16, 16, 16]  # 3 documents, the padding piece, 2 empty slots


def test_row_offsets_full_row_and_no_documents():
    # no padding: the padding's slot is an empty piece like the unused ones
    assert row_offsets([4, 4], budget=8, slots=3).tolist() == [0, 4, 8, 8]
    assert row_offsets([], budget=8, slots=2).tolist() == [0, 8, 8]  # all padding


@pytest.mark.parametrize(
    "lengths, budget, slots, message",
    [
        ([1, 1, 1], 8, 3, "need 4 slots"),  # the padding needs a slot of its own
        ([5, 4], 8, 4, "9 tokens do not fit a row of 8"),
        ([2, -1], 8, 4, "expected each >= 0"),
    ],
)
def test_row_offsets_refuses_what_does_not_fit(lengths, budget, slots, message):
    with pytest.raises(ValueError, match=message):
        row_offsets(lengths, budget, slots)


EOD = 9


def test_documents_end_after_each_end_of_document_token():
    tokens = np.array([1, 2, EOD, 3, EOD, 4, 5, 6])
    assert eod_document_lengths(tokens, EOD, max_documents=8) == [3, 2, 3]
    assert eod_document_count(tokens, EOD) == 3


def test_an_end_of_document_last_starts_no_document():
    tokens = np.array([EOD, 1, 2, EOD])  # a sample starting just after a document's end: its first token is one
    assert eod_document_lengths(tokens, EOD, max_documents=8) == [1, 3]
    assert eod_document_count(tokens, EOD) == 2
    assert eod_document_lengths(np.array([1, 2, 3]), EOD, max_documents=1) == [3]
    assert eod_document_lengths(np.array([], dtype=np.int64), EOD, max_documents=4) == []
    assert eod_document_count(np.array([], dtype=np.int64), EOD) == 0


def test_documents_beyond_the_maximum_share_the_final_span():
    tokens = np.array([EOD, EOD, 1, EOD, 2, EOD, 3, 4])  # 5 documents: [1, 1, 2, 2, 2]
    assert eod_document_lengths(tokens, EOD, max_documents=5) == [1, 1, 2, 2, 2]
    assert eod_document_lengths(tokens, EOD, max_documents=3) == [1, 1, 6]
    assert eod_document_lengths(tokens, EOD, max_documents=1) == [8]
    assert eod_document_count(tokens, EOD) == 5
    with pytest.raises(ValueError, match="max_documents=0"):
        eod_document_lengths(tokens, EOD, max_documents=0)


def test_a_sample_packs_into_its_row():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, EOD + 1, size=64)
    lengths = eod_document_lengths(tokens, EOD, max_documents=4)
    offsets = row_offsets(lengths, budget=64, slots=5)
    assert sum(lengths) == 64 and offsets[-1] == 64 and np.all(np.diff(offsets) >= 0)
    # every boundary but the merged last span's is just after an end-of-document token
    assert all(tokens[o - 1] == EOD for o in offsets[1 : len(lengths)])
