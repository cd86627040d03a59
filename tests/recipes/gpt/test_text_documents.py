""".txt files read a block at a time (recipes/gpt/text_documents.py) give exactly the documents of the rule that
read the whole text at once, kept here as the reference: in every mode, on random mixes of line ends, blank lines,
byte-order marks and Unicode whitespace, at every block size; and the same .bin/.idx for the shipped corpus.
Documents tokenized in batches get the ids they get one at a time."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from core.config.errors import DataError
from recipes.gpt import text_documents
from recipes.gpt.preprocess import preprocess, read_documents
from recipes.gpt.text_documents import TEXT_DOCUMENTS
from recipes.gpt.tokenizer import ByteTokenizer, build_tokenizer
from tests.support.helpers import REPO

MOBY_DICK = REPO / "data" / "moby_dick" / "moby_dick.txt"


def whole_text_documents(path: Path, text_document: str) -> list[str]:
    """The rule before reading a block at a time (recipes/gpt/preprocess.py at 8067eef), the whole text in memory."""
    text = path.read_bytes().decode("utf-8-sig")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text_document == "file":
        parts = [text]
    elif text_document == "line":
        parts = text.split("\n")
    else:
        parts = re.split(r"\n\s*\n", text)
    return [p.strip("\n") for p in parts if p.strip()]


# Line ends of three systems, blank and whitespace-only lines, whitespace that ends no line (form feed, U+2028,
# NEL, no-break and ideographic spaces, file separators), byte-order marks inside, several scripts.
PIECES = [
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    "\r\n\r\n",
    "\r\r",
    "\n \n",
    "\n\t\n",
    " ",
    "  ",
    "\t",
    "\x0c",
    "\x0b",
    "\u2028",
    "\u2029",
    "\x85",
    "\xa0",
    "\u3000",
    "\x1c",
    "\ufeff",
    "word",
    "Call me Ishmael.",
    "é",
    "鯨",
    "🐋",
    "ab",
    "-",
]
EDGES = [
    "",
    "\n",
    "\r",
    "\r\n",
    " ",
    " \n",
    "\n ",
    "a",
    "a\n",
    "a\n ",
    " \na",
    "\na",
    "a\n\n",
    "a\n \n",
    "\n\na",
    " \n\na",
    "a\n\n ",
    "a\r\n \r\nb",
    "\ufeff",
    "\ufeff\n",
    "\ufeffa\n\nb",
    "\ufeff\ufeff",
    " \n ",
    "\n\n\n",
    "a\x0c\nb",
    "a\u2028\u2028b",
    "\x85\n\x85a\x85\n\x85",
]


def random_text(rng: random.Random) -> bytes:
    text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 40)))
    return (b"\xef\xbb\xbf" if rng.random() < 0.3 else b"") + text.encode("utf-8")


@pytest.mark.slow
def test_reading_a_block_at_a_time_gives_the_documents_of_the_whole_text(tmp_path, monkeypatch):
    rng = random.Random(49)
    texts = [e.encode() for e in EDGES] + [b"\xef\xbb\xbf" + e.encode() for e in EDGES]
    texts += [random_text(rng) for _ in range(2000)]
    path = tmp_path / "t.txt"
    compared = 0
    for raw in texts:
        path.write_bytes(raw)
        for block in (1, rng.randrange(2, 64), 1 << 20):  # a line, a \r\n or a character cut by a block's end
            monkeypatch.setattr(text_documents, "BLOCK_BYTES", block)
            for mode in TEXT_DOCUMENTS:
                assert list(read_documents(path, text_document=mode)) == whole_text_documents(path, mode), (
                    raw,
                    block,
                    mode,
                )
                compared += 1
    assert compared == len(texts) * 3 * 3


def test_text_that_is_not_utf8_is_named_by_line_and_byte(tmp_path, monkeypatch):
    rng = random.Random(9)
    path = tmp_path / "t.txt"
    for _ in range(300):
        good = random_text(rng)
        at = rng.randrange(0, len(good) + 1)
        while at < len(good) and 0x80 <= good[at] < 0xC0:  # not inside a character
            at += 1
        raw = good[:at] + rng.choice([b"\xff", b"\xe2\x82", b"\xc3"]) + good[at:]
        path.write_bytes(raw)
        try:
            raw.decode("utf-8")
            continue  # a cut character that happens to join what follows
        except UnicodeDecodeError as e:
            line, byte = raw.count(b"\n", 0, e.start) + 1, e.start
        for block in (1, 5, 1 << 20):
            monkeypatch.setattr(text_documents, "BLOCK_BYTES", block)
            with pytest.raises(
                DataError,
                match=rf"^--input {re.escape(str(path))}:{line}: not UTF-8 text \(byte "
                rf"{byte} of the file",
            ):
                list(read_documents(path, text_document="line"))


def reference_prefix(documents: list[str], prefix: Path, tokenizer) -> None:
    """.bin/.idx as preprocess wrote them at 8067eef: each document encoded on its own, then the end of document."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    for text in documents:
        ids = np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int64)
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")


def same_files(a: Path, b: Path) -> bool:
    return all(Path(f"{a}{s}").read_bytes() == Path(f"{b}{s}").read_bytes() for s in (".bin", ".idx"))


@pytest.mark.parametrize("mode", TEXT_DOCUMENTS)
def test_the_shipped_corpus_gives_the_same_bin_and_idx(tmp_path, mode):
    summary = preprocess([MOBY_DICK], tmp_path / "new", text_document=mode)
    documents = whole_text_documents(MOBY_DICK, mode)
    reference_prefix(documents, tmp_path / "old", ByteTokenizer())
    assert summary["documents"] == len(documents) and same_files(tmp_path / "new", tmp_path / "old")


def bpe_tokenizer(folder: Path, texts: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=2000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(folder)


def test_documents_tokenized_in_batches_get_the_ids_of_one_at_a_time(tmp_path):
    paragraphs = whole_text_documents(MOBY_DICK, "paragraph")
    odd = ["", " ", "\n", "🐋 whale", "ünïcödé", "<|endoftext|> inside", "a" * 10_000]
    for tokenizer in (ByteTokenizer(), build_tokenizer(bpe_tokenizer(tmp_path / "bpe", paragraphs[:500]))):
        texts = odd + paragraphs
        assert [list(ids) for ids in tokenizer.encode_batch(texts)] == [tokenizer.encode(t) for t in texts]
    preprocess([MOBY_DICK], tmp_path / "new", str(tmp_path / "bpe"))
    reference_prefix(paragraphs, tmp_path / "old", build_tokenizer(str(tmp_path / "bpe")))
    assert same_files(tmp_path / "new", tmp_path / "old")


def test_a_large_file_is_read_in_memory_of_a_block_not_of_the_file(tmp_path):
    import tracemalloc

    text = MOBY_DICK.read_bytes()
    with open(tmp_path / "big.txt", "wb") as f:
        for _ in range(20):  # 24 MB
            f.write(text)
    for mode in ("paragraph", "line"):
        tracemalloc.start()
        try:
            count = sum(1 for _ in read_documents(tmp_path / "big.txt", text_document=mode))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert count == len(whole_text_documents(tmp_path / "big.txt", mode))
        assert peak < 16 * 2**20, f"{mode}: {peak / 2**20:.1f} MiB at the peak"  # a few 1 MiB blocks, not 24 MB


@pytest.mark.parametrize("text_document", TEXT_DOCUMENTS)
def test_a_file_without_line_ends_is_refused_at_the_line_bound_not_read_whole(tmp_path, monkeypatch, text_document):
    """A sparse file (a few bytes in a tar, gigabytes of NULs unpacked) has no line end: it was read whole, one
    document of NUL tokens (a 512 MiB one: 5 GB of memory, trained on silently). Refused at the bound, by line."""
    monkeypatch.setattr(text_documents, "MAX_LINE_BYTES", 3 << 20, raising=False)  # runs on code without it too
    monkeypatch.setattr(text_documents, "BLOCK_BYTES", 1 << 20)
    path = tmp_path / "sparse.txt"
    path.write_bytes(b"a first line\r\nthen a second\n")
    with open(path, "r+b") as f:
        f.truncate(8 << 20)
    with pytest.raises(DataError, match=r"^--input \S*sparse.txt:3: a line longer than 3 MiB \(no line end\?\)$"):
        list(read_documents(path, text_document=text_document))
