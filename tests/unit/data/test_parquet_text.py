"""A parquet file of a few KB can hold thousands of rows of one long string (stored once, compressed): the readers
of text columns refuse it before expanding it, and read real files as before."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import core.data.parquet_text as parquet_text
from core.config.errors import DataError
from recipes.esm2.sequences import read_store
from recipes.esm2_finetune.config import Task
from recipes.esm2_finetune.labels import LabelSpec, read_labelled


def write_bomb(path, rows=2048, value_bytes=64 << 10):
    """`rows` rows of one `value_bytes` sequence, dictionary-encoded and compressed: a few KB on disk."""
    one = pa.array(["M" + "A" * (value_bytes - 1)])
    sequence = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), one)
    label = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), pa.array(["1.0"]))
    table = pa.table({"sequence": sequence, "y": label})
    pq.write_table(table, path, compression="zstd", store_schema=False)  # no schema: read back as plain strings
    return path


def test_a_file_that_expands_past_its_budget_is_refused_before_it_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_text, "MIN_BUDGET_BYTES", 1 << 20)  # 128 MiB of text from ~10 KB: 1 MiB allowed
    bomb = write_bomb(tmp_path / "bomb.parquet")
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(DataError, match="bomb.parquet: unreadable .*expands to more than 1048576 bytes"):
        read_store(bomb)
    with pytest.raises(DataError, match="data.train_path=.*bomb.parquet: its text expands to more than"):
        read_labelled(bomb, "data.train_path", LabelSpec(Task.regression, ("y",)))


def test_a_value_longer_than_its_bound_is_refused_and_real_files_read(tmp_path, monkeypatch):
    import recipes.esm2.sources as sources

    monkeypatch.setattr(sources, "MAX_SEQUENCE_LENGTH", 1000)
    with pytest.raises(DataError, match="a value of column 'sequence' holds 1001 bytes \\(at most 1000\\)"):
        read_store(write_bomb(tmp_path / "long.parquet", rows=3, value_bytes=1001))
    plain = pa.table({"id": [f"p{i}" for i in range(3000)], "sequence": ["MKV", "WWWL", "A"] * 1000})
    pq.write_table(plain, tmp_path / "plain.parquet", use_dictionary=False)  # read over three batches
    store = read_store(tmp_path / "plain.parquet")
    assert len(store) == 3000 and store.name(2999) == "p2999" and store.lengths()[:3].tolist() == [3, 4, 1]


def test_a_page_holding_more_than_its_rows_may_is_refused_from_the_metadata(tmp_path, monkeypatch):
    """One row of one long value, compressed: its page is decompressed whole, so the column's stored size in the
    metadata is checked against the rows' bound before any page is read (GPT text and chat parquet files)."""
    import recipes.gpt.preprocess as preprocess

    monkeypatch.setattr(preprocess, "MAX_DOCUMENT_BYTES", 1 << 20)
    pq.write_table(pa.table({"text": ["x" * (4 << 20)]}), tmp_path / "one.parquet", compression="zstd")
    assert (tmp_path / "one.parquet").stat().st_size < 64 << 10
    with pytest.raises(DataError, match="one.parquet: row group 1 stores 41943.. bytes of column 'text' for 1 rows"):
        list(preprocess.read_parquet(tmp_path / "one.parquet", "text", "--input one.parquet", "--text-key"))
    pq.write_table(pa.table({"text": ["a document", "", "another"]}), tmp_path / "ok.parquet")
    assert list(preprocess.read_parquet(tmp_path / "ok.parquet", "text", "--input", "--text-key")) == [
        "a document",
        "another",
    ]


def test_a_column_named_twice_is_refused(tmp_path):
    """Which of two `y` columns holds the labels? Neither is guessed."""
    table = pa.Table.from_arrays([pa.array(["MKV"]), pa.array(["1"]), pa.array(["2"])], names=["sequence", "y", "y"])
    pq.write_table(table, tmp_path / "twice.parquet")
    with pytest.raises(DataError, match="twice.parquet: 2 columns are named 'y': keep one"):
        read_labelled(tmp_path / "twice.parquet", "data.train_path", LabelSpec(Task.regression, ("y",)))


def _messages_bomb(path, rows=512, value_bytes=64 << 10):
    """`rows` chats of two messages whose contents are one `value_bytes` string, stored once: under 2 KB on disk."""
    n = 2 * rows
    roles = pa.DictionaryArray.from_arrays(pa.array(np.tile(np.int32([0, 1]), rows)), pa.array(["user", "assistant"]))
    contents = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["x" * value_bytes]))
    messages = pa.StructArray.from_arrays([roles, contents], names=["role", "content"])
    offsets = pa.array(np.arange(0, n + 1, 2, dtype=np.int32))
    table = pa.table({"messages": pa.ListArray.from_arrays(offsets, messages)})
    pq.write_table(table, path, compression="zstd", store_schema=False)
    return path


def test_text_inside_lists_and_structs_is_bounded_as_top_level_text_is(tmp_path, monkeypatch):
    """A chat's messages (a list of structs of text): 64 MiB of contents from under 2 KB is a bomb too."""
    from recipes.gpt.chat import chat_template, read_chat

    monkeypatch.setattr(parquet_text, "MIN_BUDGET_BYTES", 1 << 20)
    bomb = _messages_bomb(tmp_path / "chat.parquet")
    assert bomb.stat().st_size < 2 << 10
    with pytest.raises(DataError, match="chat.parquet: its text expands to more than 1048576 bytes"):
        read_chat(bomb, "data.train_path", chat_template("byte"), 64)
    with pytest.raises(parquet_text.TextRefused, match="a value of column 'messages' holds 65536 bytes"):
        next(parquet_text.text_batches(bomb, ["messages"], 1000))


@pytest.mark.parametrize("large", [False, True])
def test_nested_text_reads_back_value_for_value_nulls_included(tmp_path, large):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "n": 1},
        {"messages": None, "n": 2},
        {"messages": [None, {"role": "user", "content": None}], "n": 3},
        {"messages": [], "n": None},
        {"messages": [{"role": "assistant", "content": "x" * 300}], "n": 5},
    ] * 7
    message = pa.struct([("role", pa.string()), ("content", pa.large_string())])
    listed = pa.large_list(message) if large else pa.list_(message)
    table = pa.Table.from_pylist(rows, schema=pa.schema([("messages", listed), ("n", pa.int64())]))
    pq.write_table(table, tmp_path / "nested.parquet", row_group_size=10)
    batches = list(parquet_text.text_batches(tmp_path / "nested.parquet", ["messages", "n"], 1000, batch_rows=4))
    assert [r for b in batches for r in b.to_pylist()] == rows
    assert len(batches) == 3 + 3 + 3 + 2  # batches of 4 rows within each row group of 10 (35 rows)


def test_text_in_a_map_is_refused_by_name(tmp_path):
    table = pa.table({"meta": pa.array([[("k", "v")]], pa.map_(pa.string(), pa.string()))})
    pq.write_table(table, tmp_path / "map.parquet")
    with pytest.raises(
        parquet_text.TextRefused, match="column 'meta' holds text within a map: text is read as strings, or"
    ):
        next(parquet_text.text_batches(tmp_path / "map.parquet", ["meta"], 1000))
