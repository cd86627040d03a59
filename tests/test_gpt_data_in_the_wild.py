"""GPT text data and tokenizer folders as users bring them: a corpus made again under the same prefix, data made
with another tokenizer, a tokenizer replaced in its folder or with unused ids, text files from Windows or with a
byte-order mark, parquet with nulls or damage, outputs that exist, a file given twice. Each is read as meant or
refused by name; nothing is trained on stale, doubled or misread data silently."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config.errors import ConfigError
from recipes.gpt import preprocess as gpt_preprocess
from recipes.gpt.data import build_gpt_datasets
from recipes.gpt.preprocess import decode_document, preprocess, read_documents
from recipes.gpt.tokenizer import build_tokenizer


def corpus(n: int) -> str:
    return "\n\n".join(f"document {i} " + "word " * 50 for i in range(n))


def indexed(tmp_path: Path, prefix: Path, tokenizer: str = "byte") -> SimpleNamespace:
    return SimpleNamespace(format="indexed", prefixes=[str(prefix)], weights=None, tokenizer=tokenizer, eod_token=None,
                           split="100,0,0", cache_dir=str(tmp_path / "cache"), eod_mask_loss=False, val_num_samples=None)


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


def test_parquet_nulls_damage_existing_outputs_and_repeated_files_are_refused_by_name(tmp_path):
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
    with pytest.raises(SystemExit, match=r"p.json exist; choose another --output-prefix"):
        gpt_preprocess.main(["--input", str(tmp_path / "ok.parquet"), "--output-prefix", str(tmp_path / "p")])
    assert (tmp_path / "p.json").read_text() == "a user's notes" and not (tmp_path / "p.bin").exists()


def test_odd_text_and_settings_are_named_not_tracebacks(tmp_path):
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
    for name, content, says in (("n.jsonl", '{"prompt": null}\n', 'n.jsonl:1: expected a JSON object with a "prompt" '
                                                                   "string"),
                                ("bad.txt", b"The whale \xff\n", "bad.txt: not UTF-8 text")):
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ConfigError, match=says):
            generate.read_prompts(tmp_path / name)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfThe whale\r\nCall me\r\n")
    assert generate.read_prompts(tmp_path / "bom.txt") == ["The whale", "Call me"]
    # --decode of a .bin/.idx made elsewhere (no <prefix>.json): the tokenizer given
    (tmp_path / "a.txt").write_text("hello there")
    preprocess([tmp_path / "a.txt"], tmp_path / "p")
    (tmp_path / "p.json").unlink()
    with pytest.raises(SystemExit, match="p.json: no such file .*give --tokenizer"):
        gpt_preprocess.main(["--decode", str(tmp_path / "p")])
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
    for code, says in ((4, r"p.bin holds 10500 bytes, its .idx describes 11026"),  # uint16 -> int32: sizes differ
                       (3, r"p.idx holds 5250 tokens of int16, its .json says 5250 of uint16")):  # same size
        index = bytearray(original)
        index[17] = code  # the token type's code, after the 9-byte magic and the 8-byte version
        (tmp_path / "p.idx").write_bytes(bytes(index))
        with pytest.raises(ConfigError, match=says):
            build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)
    (tmp_path / "p.idx").write_bytes(original)
    assert len(build_gpt_datasets(indexed(tmp_path, tmp_path / "p"), 32, 0, None, None)[0]) > 0
