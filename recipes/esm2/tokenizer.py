"""The ESM-2 vocabulary: 33 tokens, one per residue letter, in the order of fair-esm and Hugging Face's
EsmTokenizer (so token ids, embeddings and logits line up with published ESM-2 weights)."""

from __future__ import annotations

import numpy as np

VOCABULARY = (
    "<cls>",
    "<pad>",
    "<eos>",
    "<unk>",
    "L",
    "A",
    "G",
    "V",
    "S",
    "E",
    "R",
    "T",
    "I",
    "D",
    "P",
    "K",
    "Q",
    "N",
    "F",
    "Y",
    "M",
    "H",
    "W",
    "C",
    "X",
    "B",
    "U",
    "Z",
    "O",
    ".",
    "-",
    "<null_1>",
    "<mask>",
)
CLS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 32
STANDARD_AMINO_ACIDS = range(4, 24)  # L A G V S E R T I D P K Q N F Y M H W C: the random replacements of MLM
SPECIAL = (CLS, PAD, EOS, UNK, 31, MASK)

# byte -> id for the one-letter residue codes (upper and lower case); anything else is <unk>.
_CODES = np.full(256, UNK, dtype=np.uint8)
for _id, _token in enumerate(VOCABULARY):
    if len(_token) == 1:
        _CODES[ord(_token)] = _id
        _CODES[ord(_token.lower())] = _id


def encode_residues(sequence: str) -> np.ndarray:
    """A residue string -> its token ids (uint8), without <cls>/<eos>. Letters outside the vocabulary (and any
    non-ASCII character) become <unk>; spaces and line breaks are dropped."""
    raw = "".join(sequence.split()).encode("ascii", errors="replace")  # a non-ASCII character -> "?" -> <unk>
    return _CODES[np.frombuffer(raw, dtype=np.uint8)]


def decode(ids) -> str:
    """Token ids -> text; special tokens in their <...> form."""
    return "".join(VOCABULARY[int(i)] for i in ids)
