"""GPT text data and tokenizer folders as users bring them: a corpus made again under the same prefix, data made
with another tokenizer, a tokenizer replaced in its folder or with unused ids, text files from Windows or with a
byte-order mark, parquet with nulls or damage, outputs that exist, a file given twice, a .bin holding ids beyond
the vocabulary; and preprocess stopped by a signal or killed. Each is read as meant or refused by name (one line,
exit code 2, through train.py too); nothing is trained on stale, doubled or misread data silently, and no partial
output stays behind."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config.errors import ConfigError, DataError
from recipes.gpt import preprocess as gpt_preprocess
from recipes.gpt.data import build_gpt_datasets
from recipes.gpt.preprocess import decode_document, preprocess, read_documents
from recipes.gpt.tokenizer import build_tokenizer
from tests.support.helpers import run_python


def corpus(n: int) -> str:
    return "\n\n".join(f"document {i} " + "word " * 50 for i in range(n))


def indexed(tmp_path: Path, prefix: Path, tokenizer: str = "byte") -> SimpleNamespace:
    return SimpleNamespace(
        format="indexed",
        prefixes=[str(prefix)],
        weights=None,
        tokenizer=tokenizer,
        eod_token=None,
        split="100,0,0",
        cache_dir=str(tmp_path / "cache"),
        eod_mask_loss=False,
        packing=False,
        max_documents_per_sample=64,
        val_num_samples=None,
    )


def test_a_prefix_made_again_gets_a_fresh_sample_index(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(20))
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    before = len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)[0])
    (tmp_path / "a.txt").write_text(corpus(60))
    preprocess([tmp_path / "a.txt"], tmp_path / "p", replace=True)
    after = len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)[0])
    assert after > 2.5 * before  # the three times larger corpus, not the cached index of the old one


def word_level_tokenizer(folder: Path, vocab: dict[str, int]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_truncation_and_padding_saved_in_a_tokenizer_json_are_not_applied_to_documents(tmp_path):
    from tokenizers import Tokenizer

    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1, "a": 2, "b": 3})
    saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
    saved.enable_truncation(2)  # as saved for a model's inputs
    saved.enable_padding(length=64, pad_id=1, pad_token="</s>")
    saved.save(str(folder / "tokenizer.json"))
    tokenizer = build_tokenizer(str(folder))
    assert tokenizer.encode("a b a b a") == [2, 3, 2, 3, 2]
    assert [list(ids) for ids in tokenizer.encode_batch(["a b a", "b"])] == [[2, 3, 2], [3]]


def test_a_tokenizer_rule_the_regex_engine_gives_up_on_is_one_line_naming_the_tokenizer(tmp_path):
    """A pre-tokenizer pattern that backtracks past Oniguruma's limit made the tokenizers library panic (a Rust
    panic is a BaseException: a traceback from preprocess); it is a DataError naming the tokenizer now."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1, "a": 2})
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+b"), behavior="isolated")
    tok.save(str(folder / "tokenizer.json"))
    tokenizer = build_tokenizer(str(folder))
    with pytest.raises(DataError, match=f"{re.escape(str(folder))}: the tokenizer failed on the text .*retry-limit"):
        tokenizer.encode("a" * 28 + "!")
    with pytest.raises(DataError, match="the tokenizer failed on the text"):
        tokenizer.encode_batch(["a" * 28 + "!"])


@pytest.mark.parametrize("top", [2**31 - 2, 4_000_000_000])
def test_a_token_id_far_beyond_the_vocabulary_is_refused_by_name(tmp_path, top):
    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1, "a": 2})
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"]["<|huge|>"] = top  # the model would get an embedding of billions of rows
    (folder / "tokenizer.json").write_text(json.dumps(data))
    says = rf"tok/tokenizer.json: the token '<\|huge\|>' has the id {top}, far beyond its 4 tokens"
    with pytest.raises(DataError, match=says):
        build_tokenizer(str(folder))
    data["model"]["vocab"]["<|huge|>"] = 100_000  # ids left unused, not billions: taken as is
    (folder / "tokenizer.json").write_text(json.dumps(data))
    assert build_tokenizer(str(folder)).vocab_size == 100_001


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_far_larger_than_a_vocabulary_is_refused_before_it_is_read(tmp_path, monkeypatch, name):
    from recipes.gpt import tokenizer

    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1, "a": 2})
    monkeypatch.setattr(tokenizer, "TOKENIZER_FILE_MAX_BYTES", 4000)
    build_tokenizer(str(folder))
    with open(folder / name, "r+b") as f:
        f.truncate(4001)  # sparse: reading it whole would take its apparent size in memory
    says = rf"^data.tokenizer=\S*tok: \S*tok/{name}: it is larger than 4000 bytes, far more than a file"
    says += " of this kind holds$"  # the whole message: no other error wrapped around it
    with pytest.raises(DataError, match=says):
        build_tokenizer(str(folder))


def test_data_and_tokenizer_must_be_the_pair_they_were_made_as(tmp_path):
    words = {"<unk>": 0, "</s>": 1, "document": 2, "word": 3}
    folder = word_level_tokenizer(tmp_path / "tok", words | {"0": 4})
    (tmp_path / "a.txt").write_text(corpus(20))
    preprocess([tmp_path / "a.txt"], tmp_path / "p", str(folder))
    assert len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p", str(folder)), 8, 0, None, None)[0]) > 0
    with pytest.raises(ConfigError, match=r"data.tokenizer=byte: .*p.bin/.idx were tokenized with .*tok"):
        build_gpt_datasets(indexed(tmp_path, tmp_path / "p", "byte"), 8, 0, None, None)
    # The same folder, its tokenizer.json replaced by another vocabulary of the same size and end-of-document id
    word_level_tokenizer(folder, words | {"1": 4})
    with pytest.raises(ConfigError, match="tokenizer_sha256"):
        build_gpt_datasets(indexed(tmp_path, tmp_path / "p", str(folder)), 8, 0, None, None)
    # A vocabulary with unused ids: its size is the highest id + 1 (the model's embedding rows, the .bin's dtype)
    gaps = build_tokenizer(str(word_level_tokenizer(tmp_path / "gaps", words | {"0": 70_000})))
    assert gaps.vocab_size == 70_001 and gaps.encode("document 0") == [2, 70_000]
    (tmp_path / "gaps" / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(ValueError, match=r"gaps/tokenizer.json: not a tokenizer.json .* Git LFS pointer"):
        build_tokenizer(str(tmp_path / "gaps"))


def test_text_files_from_windows_or_with_a_byte_order_mark_give_their_text(tmp_path):
    (tmp_path / "w.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nstill first\r\n\r\nSecond\r\n")
    assert list(read_documents(tmp_path / "w.txt")) == ["First line\nstill first", "Second"]
    (tmp_path / "l.txt").write_text("one\x0cpage two\nline\u2028same line\n")
    assert list(read_documents(tmp_path / "l.txt", text_document="line")) == ["one\x0cpage two", "line\u2028same line"]
    preprocess([tmp_path / "w.txt"], tmp_path / "p")
    assert decode_document(tmp_path / "p", 0) == "First line\nstill first"


def test_blank_texts_are_left_out_alike_and_a_jsonl_may_start_with_a_byte_order_mark(tmp_path, monkeypatch):
    """Blank texts were documents of an end-of-document token alone from .jsonl, left out from .parquet only when
    empty, and from .txt; now every format leaves them out. A .jsonl from a Windows tool (a byte-order mark) was
    refused, while chat and prompt files read it; and a line without end (a sparse file) is refused at its bound."""
    texts = ["real one", "", "   \n", "real two"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("real one\n\n   \n\nreal two\n")
    for name in ("a.jsonl", "a.parquet", "a.txt"):
        assert list(read_documents(tmp_path / name)) == ["real one", "real two"], name
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hello"}).encode() + b"\n")
    assert list(read_documents(tmp_path / "bom.jsonl")) == ["hello"]
    monkeypatch.setattr(gpt_preprocess, "MAX_LINE_BYTES", 100)
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "x" * 200}) + "\n")
    with pytest.raises(DataError, match="long.jsonl:1: a line longer than"):
        list(read_documents(tmp_path / "long.jsonl"))


def test_parquet_nulls_damage_existing_outputs_and_repeated_files_are_refused_by_name(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a document", None, "another"]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet: row 1: no text in the column 'text'"):
        list(read_documents(tmp_path / "n.parquet"))
    pq.write_table(pa.table({"text": ["a document"] * 100}), tmp_path / "ok.parquet")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "ok.parquet").read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.parquet: unreadable as parquet"):
        list(read_documents(tmp_path / "cut.parquet"))
    with pytest.raises(ValueError, match="ok.parquet: given twice"):
        preprocess([tmp_path / "ok.parquet", tmp_path / "." / "ok.parquet"], tmp_path / "p")
    (tmp_path / "notes.md").write_text("# notes")
    with pytest.raises(ValueError, match=r"notes.md: unknown input type"):  # before any file is tokenized
        preprocess([tmp_path / "ok.parquet", tmp_path / "notes.md"], tmp_path / "p")
    (tmp_path / "p.json").write_text("a user's notes")
    with pytest.raises(SystemExit) as exited:
        gpt_preprocess.main(["--input", str(tmp_path / "ok.parquet"), "--output-prefix", str(tmp_path / "p")])
    assert exited.value.code == 2 and "p.json exist; choose another --output-prefix" in capsys.readouterr().err
    assert (tmp_path / "p.json").read_text() == "a user's notes" and not (tmp_path / "p.bin").exists()


def test_odd_text_and_settings_are_named_not_tracebacks(tmp_path, capsys):
    import generate

    (tmp_path / "s.jsonl").write_text('{"text": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=r"s.jsonl:1: the text holds a lone UTF-16 surrogate"):
        list(read_documents(tmp_path / "s.jsonl"))
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep.jsonl:1: not JSON \(RecursionError"):
        list(read_documents(tmp_path / "deep.jsonl"))
    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1})
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": ["</s>"]}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: eos_token is \['</s>'\], expected a token's text"):
        build_tokenizer(str(folder))
    for name, content, says in (
        ("n.jsonl", '\n{"prompt": null}\n', 'n.jsonl: line 2: expected a JSON object with a "prompt" string'),
        ("bad.txt", b"The whale \xff\n", "bad.txt: not UTF-8 text"),
    ):
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(DataError, match=f"^generate.prompt_file={re.escape(str(tmp_path))}/{says}"):
            generate.read_prompts(tmp_path / name)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfThe whale\r\nCall me\r\n")
    assert [p.text for p in generate.read_prompts(tmp_path / "bom.txt")] == ["The whale", "Call me"]
    # --decode of a .bin/.idx made elsewhere (no <prefix>.json): the tokenizer given
    (tmp_path / "a.txt").write_text("hello there")
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    (tmp_path / "p.json").unlink()
    with pytest.raises(SystemExit) as exited:
        gpt_preprocess.main(["--decode", str(tmp_path / "p")])
    assert exited.value.code == 2 and re.search("p.json: no such file .*give --tokenizer", capsys.readouterr().err)
    gpt_preprocess.main(["--decode", str(tmp_path / "p"), "--tokenizer", "byte"])


def test_a_damaged_bin_or_idx_is_named_before_training(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(20))
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    whole = (tmp_path / "p.bin").read_bytes()
    (tmp_path / "p.bin").write_bytes(whole[:-1000])  # an rsync cut short
    with pytest.raises(ConfigError, match=r"p.bin holds \d+ bytes, its .idx describes \d+: a copy cut short"):
        build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)
    (tmp_path / "p.bin").write_bytes(whole)
    original = (tmp_path / "p.idx").read_bytes()
    for code, says in (
        (4, r"p.bin holds 10500 bytes, its .idx describes 11026"),  # uint16 -> int32: sizes differ
        (3, r"p.idx holds 5250 tokens of int16, its .json says 5250 of uint16"),
    ):  # same size
        index = bytearray(original)
        index[17] = code  # the token type's code, after the 9-byte magic and the 8-byte version
        (tmp_path / "p.idx").write_bytes(bytes(index))
        with pytest.raises(ConfigError, match=says):
            build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)
    (tmp_path / "p.idx").write_bytes(original)
    assert len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)[0]) > 0
    # A <prefix>.json nested 100,000 deep (a RecursionError traceback) is not ours: the size check alone holds.
    (tmp_path / "p.json").write_text("[" * 100_000 + "]" * 100_000)
    assert len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)[0]) > 0


SLOW_INPUT = '''"""preprocess's command line with its input held open: after the last document it says READY (a file)
and waits for GO. With --nohup, SIGHUP is ignored first, as nohup does."""
import signal
import sys
import time
from pathlib import Path

from recipes.gpt import preprocess

folder = Path(sys.argv.pop(1))
read_documents = preprocess.read_documents


def held_open(*args, **kwargs):
    yield from read_documents(*args, **kwargs)
    (folder / "READY").touch()
    while not (folder / "GO").exists():
        time.sleep(0.02)


preprocess.read_documents = held_open
for sig in (signal.SIGTERM, signal.SIGHUP):  # as a shell starts it, whatever the test runner's were (nohup pytest)
    signal.signal(sig, signal.SIG_DFL)
if "--nohup" in sys.argv:
    sys.argv.remove("--nohup")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
preprocess.main(sys.argv[1:])
'''


def start_preprocess_held_open(folder: Path, *options: str):
    from tests.support.helpers import start_python

    (folder / "READY").unlink(missing_ok=True)
    (folder / "GO").unlink(missing_ok=True)
    (folder / "slow_input.py").write_text(SLOW_INPUT)
    started = start_python(
        folder / "slow_input.py", folder, "--input", folder / "a.txt", "--output-prefix", folder / "out" / "p", *options
    )
    deadline = time.time() + 300
    while not (folder / "READY").exists():
        assert time.time() < deadline, started.finish(1)
        time.sleep(0.05)
    assert list((folder / "out").glob("p.tmp-*.bin"))  # writing
    return started


def outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "out").iterdir())


@pytest.mark.slow
def test_a_stopped_preprocess_leaves_nothing_and_a_killed_ones_leftovers_go_with_the_next_run(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(50))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a scheduler's stop; a closed terminal
        started = start_preprocess_held_open(tmp_path)
        os.kill(started.pid, sig)
        proc = started.finish(60)
        assert proc.returncode == 128 + sig, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: stopped by {sig.name}; nothing was written to {tmp_path / 'out' / 'p'}"
        ]
        assert outputs(tmp_path) == []
    # Under nohup SIGHUP stays ignored: the run goes on and writes its outputs
    started = start_preprocess_held_open(tmp_path, "--nohup")
    os.kill(started.pid, signal.SIGHUP)
    time.sleep(0.5)
    (tmp_path / "GO").touch()
    proc = started.finish(60)
    assert proc.returncode == 0 and outputs(tmp_path) == ["p.bin", "p.idx", "p.json"], proc.stderr[-2000:]
    assert decode_document(tmp_path / "out" / "p", 49) == corpus(50).split("\n\n")[49]
    # SIGKILL cannot be answered: the next run for the prefix removes what it left, and says so
    for file in (tmp_path / "out").iterdir():
        file.unlink()
    started = start_preprocess_held_open(tmp_path)
    os.kill(started.pid, signal.SIGKILL)
    assert started.finish(60).returncode == -signal.SIGKILL
    left = outputs(tmp_path)
    assert left and all(name.startswith("p.tmp-") for name in left)
    proc = run_python(
        "-m", "recipes.gpt.preprocess", "--input", tmp_path / "a.txt", "--output-prefix", tmp_path / "out" / "p"
    )
    assert proc.returncode == 0 and outputs(tmp_path) == ["p.bin", "p.idx", "p.json"], proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if "removed" in line]
    assert len(said) == 1 and f"process {started.pid} gone" in said[0] and all(name in said[0] for name in left)


def test_leftovers_of_gone_processes_on_this_host_are_removed_and_no_others(tmp_path, caplog):
    (tmp_path / "a.txt").write_text(corpus(5))
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])
    host = socket.gethostname()
    try:
        removed = [f"p.tmp-{host}-{gone.pid}.bin", f"p.tmp-{host}-{gone.pid}.idx", f"p.tmp-{gone.pid}.bin"]
        kept = [
            f"p.tmp-{host}-{live.pid}.bin",  # a run that is writing now
            f"p.tmp-{host}x-{gone.pid}.bin",  # another host's (a shared file system): its process is unknown here
            "p.tmp-notes.txt",
            "q.tmp-1.bin",
        ]  # not ours
        for name in removed + kept:
            (tmp_path / name).write_bytes(b"partial")
        with caplog.at_level(logging.WARNING):
            preprocess([tmp_path / "a.txt"], tmp_path / "p")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["a.txt", "p.bin", "p.idx", "p.json"])
        said = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
        assert len(said) == 1 and f"process {gone.pid} gone" in said[0] and all(name in said[0] for name in removed)
    finally:
        live.kill()
        live.wait()


def hand_made_pair(prefix: Path, tokens, lengths, pointers=None, documents=None, code: int = 8, dtype="<u2") -> None:
    """A .bin/.idx pair written byte by byte in Megatron-Core's layout (no .json: files from elsewhere), any of
    its fields as given: `code` is the .idx's token type (8: uint16), `dtype` how the .bin is written."""
    import numpy as np

    item = np.dtype(dtype).itemsize
    lengths = np.asarray(lengths, "<i4")
    if pointers is None:
        pointers = np.concatenate(([0], np.cumsum(lengths[:-1]))) * item
    documents = np.arange(len(lengths) + 1) if documents is None else documents
    Path(f"{prefix}.bin").write_bytes(np.asarray(tokens, dtype).tobytes())
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(documents))
    body = lengths.tobytes() + np.asarray(pointers, "<i8").tobytes() + np.asarray(documents, "<i8").tobytes()
    Path(f"{prefix}.idx").write_bytes(head + body)


@pytest.mark.parametrize(
    "fields, says",
    [  # lengths summing to 0 tokens: Megatron-Core looked forever for an epoch's worth
        ({"tokens": [65], "lengths": [-1, 1], "pointers": [0, 0]}, "document 0 holds -1 tokens"),
        ({"tokens": [65], "lengths": [0, 1], "pointers": [0, 0]}, "document 0 holds 0 tokens"),
        # pointers past the .bin (an error mid-run) or overlapping (documents read twice, silently)
        ({"tokens": [65] * 6, "lengths": [2, 2, 2], "pointers": [10**9, 4, 8]}, "document 0 starts at byte 10+"),
        ({"tokens": [65] * 6, "lengths": [2, 2, 2], "pointers": [0, 0, 8]}, "document 1 starts at byte 0, not at 4"),
        ({"tokens": [65] * 6, "lengths": [2, 2, 2], "documents": [0, 1]}, r"unreadable \(its document indices"),
        ({"tokens": [65.5] * 6, "lengths": [3, 3], "code": 6, "dtype": "<f8"}, "token type float64, not an integer"),
    ],
)
def test_an_idx_whose_documents_are_not_laid_end_to_end_is_refused_at_start(tmp_path, fields, says):
    hand_made_pair(tmp_path / "p", **fields)
    with pytest.raises(DataError, match=rf"^data.prefixes: {re.escape(str(tmp_path))}/p.idx: {says}"):
        build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, 100, None)


def test_negative_token_ids_of_a_signed_token_type_are_refused_by_position(tmp_path):
    tokens = [72, 105, -300, 33, 256] * 40
    hand_made_pair(tmp_path / "p", tokens, [5] * 40, code=3, dtype="<i2")  # int16, from elsewhere
    train = build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 16, 0, 10, None)[0]
    with pytest.raises(DataError, match=r"p.bin: document \d+ holds the token id -300 at position 2, outside the voc"):
        train[0]


def with_token_ids(tmp_path: Path, documents: int, ids: dict[tuple[int, int], int]) -> Path:
    """A corpus tokenized as usual, then ids written over its tokens in the .bin ({(document, position): id}):
    the files keep their sizes, so every check of the .idx and .json passes."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (tmp_path / "a.txt").write_text(corpus(documents))
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    index = IndexedDataset(str(tmp_path / "p")).index  # held: its arrays are views of its memory map
    pointers = index.sequence_pointers.tolist()
    data = bytearray((tmp_path / "p.bin").read_bytes())
    for (document, position), value in ids.items():
        struct.pack_into("<H", data, pointers[document] + 2 * position, value)  # byte ids are uint16
    (tmp_path / "p.bin").write_bytes(bytes(data))
    return tmp_path / "p"


def test_token_ids_beyond_the_vocabulary_are_refused_by_file_document_and_position(tmp_path):
    from recipes.gpt.data import document_windows

    prefix = with_token_ids(tmp_path, 20, {(7, 11): 300})  # below the model's padded 384 rows: no IndexError
    train = build_gpt_datasets(indexed(tmp_path, prefix), 32, 0, None, None)[0]
    says = (
        rf"^data.prefixes: {re.escape(str(prefix))}.bin: document 7 holds the token id 300 at position 11, "
        r"outside the vocabulary of data.tokenizer=byte \(258 ids\)"
    )
    for dataset in (train, pickle.loads(pickle.dumps(train)), document_windows(train, "train", 32, 256, False)):
        with pytest.raises(DataError, match=says):  # whichever sample holds it, as read (a loader worker: pickled)
            for i in range(len(dataset)):
                dataset[i]
    (tmp_path / "fine").mkdir()
    with_token_ids(tmp_path / "fine", 20, {(7, 11): 257})  # the byte tokenizer's padding id: in the vocabulary
    assert (
        len([sample for sample in build_gpt_datasets(indexed(tmp_path, tmp_path / "fine" / "p"), 32, 0, None, None)[0]])
        > 0
    )


@pytest.mark.slow
def test_training_on_ids_beyond_the_vocabulary_ends_in_one_line_naming_the_file(tmp_path):
    """An id past the embedding's rows, met by a loader worker: one line and exit 2, not an IndexError's traceback
    from the model (a device-side assert on a GPU)."""
    prefix = with_token_ids(tmp_path, 60, {(d, p): 5000 for d in range(60) for p in range(0, 250, 40)})
    proc = run_python(
        "train.py",
        "--config-name",
        "gpt_sanity",
        "data=gpt_indexed",
        f"data.prefixes=[{prefix}]",
        f"data.cache_dir={tmp_path}/cache",
        "data.num_workers=1",
        "training.steps=2",
        "training.micro_batch_size=2",
        "training.global_batch_size=2",
        f"checkpoint.path={tmp_path}/ck",
        f"hydra.run.dir={tmp_path}/run",
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    said = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(said) == 1 and "Traceback" not in output, output[-3000:]
    assert re.search(
        rf"data error: data.prefixes: {re.escape(str(prefix))}.bin: document \d+ holds the token id 5000 "
        r"at position \d+, outside the vocabulary of data.tokenizer=byte \(258 ids\)",
        said[0],
    ), said


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text file", "tokenizer folder", "prefix"])
def test_gpt_data_files_training_cannot_use_end_in_one_line_naming_file_and_setting(tmp_path, case):
    (tmp_path / "tok").mkdir()
    (tmp_path / "bad.txt").write_bytes(b"Call me Ishmael.\n\nThe whale \xff\n")
    (tmp_path / "good.txt").write_text(corpus(20))
    (tmp_path / "p.bin").write_bytes(b"\0" * 64)
    overrides, says = {
        "text file": (
            [f"data.text_files=[{tmp_path}/bad.txt]"],
            f"data.text_files={tmp_path}/bad.txt:3: not UTF-8 text (byte 28 of the file",
        ),
        "tokenizer folder": (
            [f"data.text_files=[{tmp_path}/good.txt]", f"data.tokenizer={tmp_path}/tok"],
            f"data.tokenizer={tmp_path}/tok: no tokenizer.json there",
        ),
        "prefix": (["data=gpt_indexed", f"data.prefixes=[{tmp_path}/p]"], f"data.prefixes: {tmp_path}/p.idx not found"),
    }[case]
    proc = run_python(
        "train.py",
        "--config-name",
        "gpt_sanity",
        *overrides,
        f"data.cache_dir={tmp_path}/cache",
        "training.steps=2",
        f"checkpoint.path={tmp_path}/ck",
        f"hydra.run.dir={tmp_path}/run",
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    said = [line for line in output.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in output, output[-3000:]
    assert f"data error: {says}" in said[0], said


def test_a_stop_signal_during_the_renames_waits_for_them_then_goes_where_it_would_have(tmp_path, monkeypatch):
    from recipes.gpt import partial_outputs as partial

    got = []
    replace = os.replace

    def signalled_between(src, dst):
        os.kill(os.getpid(), signal.SIGHUP)  # after the first rename: the pair would be cut in two
        replace(src, dst)

    def record(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGHUP, record)
    try:
        with partial.partial_outputs(tmp_path / "p.tmp") as commit:
            for suffix in partial.SUFFIXES:
                (tmp_path / f"p.tmp{suffix}").write_text(suffix)
            monkeypatch.setattr(partial.os, "replace", signalled_between)
            commit(tmp_path / "p")
            assert got == []  # held
        assert got == [signal.SIGHUP] and signal.getsignal(signal.SIGHUP) is record  # given back
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.bin", "p.idx", "p.json"]


def test_a_normalizer_or_decoder_that_multiplies_a_text_is_refused_by_name(tmp_path):
    """Four Replace rules, each making an "a" ten: one "a" normalized to 10,000 (10 to 10 million tokens, GBs in the
    tokenizers library, where nothing bounds it). Refused when the folder is read; real rules are taken."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers

    folder = word_level_tokenizer(tmp_path / "tok", {"<unk>": 0, "</s>": 1, "a": 2, "▁": 3})
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("a", "a" * 10)] * 4)
    tok.save(str(folder / "tokenizer.json"))
    says = r"tok/tokenizer.json: its normalizer's Replace and Prepend rules can make a text 10,000 times longer"
    with pytest.raises(DataError, match=says):
        build_tokenizer(str(folder))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])  # Llama 2's
    tok.decoder = decoders.Sequence([decoders.Replace("a", "a" * 10), decoders.Replace(Regex("a*"), "b" * 9)])
    tok.save(str(folder / "tokenizer.json"))
    with pytest.raises(DataError, match="its decoder's Replace and Prepend rules can make a text 100 times longer"):
        build_tokenizer(str(folder))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), "▁")])  # T5's
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(folder / "tokenizer.json"))
    assert build_tokenizer(str(folder)).encode("a  a") == [2, 3, 2]


def test_a_split_shorter_than_one_sample_is_refused_naming_model_seq_length(tmp_path):
    """Megatron-Core would make each training sample of the split's tokens repeated over as many epochs as it takes
    (model.seq_length=1e8 over Moby-Dick hung building their indices), and a validation split would be left out."""
    (tmp_path / "a.txt").write_text(corpus(4))  # about 1,000 byte tokens
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    with pytest.raises(DataError, match=r"^model.seq_length=5000: the training split of data.prefixes \(.*/p\) holds"):
        build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 5000, 0, 4, None)
    (tmp_path / "a.txt").write_text(corpus(10))
    preprocess([tmp_path / "a.txt"], tmp_path / "p", replace=True)
    data = SimpleNamespace(**{**vars(indexed(tmp_path, tmp_path / "p")), "split": "80,20,0"})
    tokens = len(build_gpt_datasets(data, 8, 0, 4, None)[1]) * 8  # the validation split's samples of 8 tokens
    with pytest.raises(DataError, match=r"the validation split of data.prefixes .* fewer than one sample's"):
        build_gpt_datasets(data, tokens + 100, 0, 4, None)  # the training split holds 4 times as many
