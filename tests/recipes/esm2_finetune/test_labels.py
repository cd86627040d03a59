"""Labelled files: every format read alike (odd but valid files too), and bad labels refused naming the file, row
and column before any work."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config.errors import DataError
from recipes.esm2.tokenizer import encode_residues
from recipes.esm2_finetune.config import Task
from recipes.esm2_finetune.labels import UNLABELLED, LabelSpec, read_labelled

ROWS = [
    {"id": "p1", "sequence": "MKTAYIAK", "y": 1.5, "c": "b", "ss": "HHHEEECC"},
    {"id": "p2", "sequence": "LLGV", "y": -2.0, "c": "a", "ss": "CCHH"},
    {"id": "p1", "sequence": "mkq", "y": 0.25, "c": "b", "ss": "ECC"},  # a duplicate id, lower case
]


def write(path, rows, kind=None):
    kind = kind or path.suffix[1:]
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        sep = "\t" if kind == "tsv" else ","
        columns = list(rows[0])
        lines = [sep.join(columns)] + [sep.join(str(r.get(c, "")) for c in columns) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


def read(path, task=Task.regression, columns=("y",), classes=None, **kw):
    return read_labelled(path, "data.train_path", LabelSpec(task, tuple(columns), classes, **kw))


@pytest.mark.parametrize("kind", ["csv", "tsv", "parquet", "jsonl"])
def test_every_format_reads_the_same_sequences_and_labels(tmp_path, kind):
    path = write(tmp_path / f"x.{kind}", ROWS)
    got = read(path)["all"]
    assert got.ids == ["p1", "p2", "p1"]
    assert got.residues.tolist() == encode_residues("MKTAYIAKLLGVMKQ").tolist()
    assert got.offsets.tolist() == [0, 8, 12, 15]
    assert got.targets[:, 0].tolist() == [1.5, -2.0, 0.25]
    classes = read(path, Task.classification, ("c",))["all"]
    assert classes.classes == ("a", "b") and classes.targets.tolist() == [1, 0, 1]
    residue = read(path, Task.residue_classification, ("ss",))["all"]
    assert residue.classes == ("C", "E", "H")
    assert residue.targets.tolist() == [2, 2, 2, 1, 1, 1, 0, 0, 0, 0, 2, 2, 1, 0, 0]


def test_odd_but_valid_files(tmp_path):
    """A byte-order mark, CRLF line ends, quoted fields (a comma, a line break), extra columns, a blank line, no id
    column (row numbers as ids), spaces in a sequence, residue labels as names or a list with nulls."""
    text = '\ufeffsequence,notes,y,ss\r\n"MK TA","a, quoted\r\nnote",3,H H E C\r\n\r\nLLG,x,4,CCC\r\n'
    (tmp_path / "odd.csv").write_text(text, encoding="utf-8", newline="")
    got = read(tmp_path / "odd.csv")["all"]
    assert got.ids == ["2", "4"] and got.targets[:, 0].tolist() == [3.0, 4.0] and got.offsets.tolist() == [0, 4, 7]
    residue = read(tmp_path / "odd.csv", Task.residue_classification, ("ss",))["all"]
    assert residue.targets.tolist() == [2, 2, 1, 0, 0, 0, 0]
    rows = [{"sequence": "MKT", "ss": ["H", None, "E"]}]
    listed = read(write(tmp_path / "l.parquet", rows), Task.residue_classification, ("ss",))["all"]
    assert listed.targets.tolist() == [1, UNLABELLED, 0] and listed.classes == ("E", "H")


def test_classes_sort_as_numbers_when_they_are_numbers_and_a_split_column_splits(tmp_path):
    rows = [{"sequence": "MK", "c": c, "split": s} for c, s in [(10, "train"), (2, "Valid"), (1, "train"), (2, "test")]]
    found = read(write(tmp_path / "s.jsonl", rows), Task.classification, ("c",), split_column="split")
    assert sorted(found) == ["test", "train", "val"]
    assert found["train"].classes == ("1", "2", "10") and found["train"].targets.tolist() == [2, 0]
    assert found["val"].targets.tolist() == [1]


def test_a_huge_field_and_many_rows_stream(tmp_path):
    long = "MKTAYIAK" * 40_000  # 320,000 residues in one field: over the csv module's default field limit
    path = tmp_path / "big.csv"
    with open(path, "w") as f:
        f.write("sequence,y\n")
        f.write(f"{long},1\n")
        for i in range(20_000):
            f.write(f"MKTAY,{i}\n")
    got = read(path)["all"]
    assert len(got) == 20_001 and got.offsets[1] == 320_000 and got.targets[-1, 0] == 19_999


BAD = [
    # (file name, content, task, columns, classes, the message's pattern)
    ("a.csv", "sequence,y\nMK,1\nLL,\n", "regression", ["y"], None, r"a\.csv: row 3, column 'y': no label"),
    ("a.csv", "sequence,y\nMK,1\nLL,abc\n", "regression", ["y"], None, r"row 3, column 'y': 'abc' is not a number"),
    ("a.csv", "sequence,y\nMK,nan\n", "regression", ["y"], None, r"row 2, column 'y': 'nan' is not a finite"),
    ("a.csv", "sequence,y\nMK,1\n", "regression", ["z"], None, r"a\.csv: no column 'z'"),
    ("a.csv", "seq,y\nMK,1\n", "regression", ["y"], None, r"no column 'sequence'"),
    ("a.csv", "sequence,y\n,1\n", "regression", ["y"], None, r"row 2, column 'sequence': no sequence"),
    ("a.csv", "sequence,y\nMK1,1\n", "regression", ["y"], None, r"column 'sequence': '1' at residue 3 is not an amino"),
    ("a.csv", "sequence,y\n" + "ACGT" * 10 + ",1\n", "regression", ["y"], None, r"row 2.*nucleotide letters only"),
    ("a.csv", "sequence,y\nMK--TA..Y,1\n", "regression", ["y"], None, r"'-' at residue 3 is an alignment gap"),
    ("a.csv", "sequence,c\nMK,1\nLL,1.0\n", "classification", ["c"], None, r"'1' and '1.0' are one number"),
    ("a.csv", "sequence,c\nMK,x\nLL,q\n", "classification", ["c"], ("x", "y"), r"row 3, column 'c': class 'q' is not"),
    (
        "a.csv",
        "sequence,ss\nMKT,HH\n",
        "residue_classification",
        ["ss"],
        None,
        r"column 'ss': 2 residue labels for .* 3",
    ),
    ("a.csv", "sequence,ss\nMKT,HZH\n", "residue_classification", ["ss"], ("H", "E"), r"class 'Z' is not one of"),
    ("a.csv", "sequence,m\nMK,maybe\n", "multilabel", ["m"], None, r"column 'm': 'maybe' is not a yes/no"),
    ("a.csv", "sequence,y\nMK,1,2\n", "regression", ["y"], None, r"row 2 has 3 fields, the header 2"),
    ("a.csv", "", "regression", ["y"], None, r"an empty file"),
    ("a.csv", b"sequence,y\nM\xff,1\n", "regression", ["y"], None, r"not UTF-8"),
    ("a.jsonl", '{"sequence": "MK", "y": 1}\n[1, 2]\n', "regression", ["y"], None, r"line 2 is not a JSON object"),
    ("a.jsonl", '{"sequence": "MK", "y": 1}\n{"sequence": "MK"\n', "regression", ["y"], None, r"line 2 is not JSON"),
    ("a.jsonl", '{"sequence": "MK"}\n', "regression", ["y"], None, r"line 1 has no 'y'"),
    ("a.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "regression", ["y"], None, r"line 1 nests its JSON too deeply"),
    ("a.jsonl", '{"sequence": "MK", "y": true}\n', "regression", ["y"], None, r"line 1, column 'y': True is not"),
    ("a.jsonl", '{"sequence": 12, "y": 1}\n', "regression", ["y"], None, r"column 'sequence': 12 is not a sequence"),
    ("a.jsonl", '{"sequence": "MK", "y": 1, "s": "dev2"}\n', "regression", ["y"], None, r"split 'dev2'"),
    ("a.parquet", None, "regression", ["y"], None, r"a\.parquet: row 2, column 'y': no label"),
    ("a.xlsx", "x", "regression", ["y"], None, r"expected a \.csv, \.tsv, \.parquet or \.jsonl"),
    ("a.parquet", "not parquet", "regression", ["y"], None, r"not a readable parquet file"),
]


@pytest.mark.parametrize("name,content,task,columns,classes,pattern", BAD)
def test_bad_label_files_are_refused_naming_file_row_and_column(
    tmp_path, name, content, task, columns, classes, pattern
):
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"sequence": ["MK", "LL"], "y": [1.0, None]}), path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    split = "s" if "dev2" in str(content) else None
    with pytest.raises(DataError, match=pattern) as refused:
        read(path, Task(task), columns, classes, split_column=split)
    assert str(refused.value).startswith(f"data.train_path={path}: ")
    assert "\n" not in str(refused.value)


def test_a_file_without_labels_reads_unlabelled_for_prediction_only(tmp_path):
    path = write(tmp_path / "new.csv", [{"id": "q", "sequence": "MKT"}])
    with pytest.raises(DataError, match=re.escape("no column 'y'")):
        read(path)
    got = read(path, labels_required=False)["all"]
    assert got.targets is None and got.ids == ["q"] and np.array_equal(got.residues, encode_residues("MKT"))


def test_missing_values_as_pandas_writes_them_are_no_class(tmp_path):
    """NaN in JSON (what json.dumps writes for pandas' NaN) and NA / nan / null in text were new classes, the head
    one output wider; they are missing labels now (refused naming the row), or unlabelled residues in a list; a
    class named NA stays possible through model.classes."""
    (tmp_path / "nan.jsonl").write_text('{"sequence": "MKT", "c": "a"}\n{"sequence": "LLG", "c": NaN}\n')
    with pytest.raises(DataError, match="nan.jsonl: line 2, column 'c': no label"):
        read(tmp_path / "nan.jsonl", Task.classification, ("c",))
    (tmp_path / "na.csv").write_text("sequence,c\nMKT,a\nLLG,NA\n")
    with pytest.raises(DataError, match="na.csv: row 3, column 'c': 'NA' reads as a missing label"):
        read(tmp_path / "na.csv", Task.classification, ("c",))
    assert read(tmp_path / "na.csv", Task.classification, ("c",), classes=("a", "NA"))["all"].targets.tolist() == [0, 1]
    (tmp_path / "res.jsonl").write_text('{"sequence": "MKT", "ss": ["H", NaN, "E"]}\n')
    residue = read(tmp_path / "res.jsonl", Task.residue_classification, ("ss",))["all"]
    assert residue.targets.tolist() == [1, UNLABELLED, 0] and residue.classes == ("E", "H")


def test_a_column_named_twice_and_a_line_without_end_are_refused(tmp_path, monkeypatch):
    """A header naming a label column twice kept the last one's values, silently; a CSV or JSON Lines file with no
    line end (a sparse file of gigabytes) was read whole as one line: refused at the bound (made small here)."""
    import core.data.json_lines
    import recipes.esm2_finetune.labels as labels

    (tmp_path / "twice.csv").write_text("sequence,y,y\nMKT,1,2\n")
    with pytest.raises(DataError, match="twice.csv: the header names 'y' more than once"):
        read(tmp_path / "twice.csv")
    monkeypatch.setattr(labels, "MAX_LINE_CHARACTERS", 1000)
    monkeypatch.setattr(core.data.json_lines, "MAX_LINE_BYTES", 1000)
    long_line = "A" * 1001
    (tmp_path / "long.csv").write_text(f"sequence,y\nMKT,1\n{long_line},2\n")
    with pytest.raises(DataError, match="long.csv: line 3 is longer than"):
        read(tmp_path / "long.csv")
    (tmp_path / "long.jsonl").write_text(f'{{"sequence": "MKT", "y": 1}}\n{{"sequence": "{long_line}", "y": 2}}\n')
    with pytest.raises(DataError, match="long.jsonl: line 2 is longer than"):
        read(tmp_path / "long.jsonl")
    (tmp_path / "fits.csv").write_text(f"sequence,y\n{'M' * 996},1\r\n")  # 998 characters and CRLF: within
    assert read(tmp_path / "fits.csv")["all"].offsets.tolist() == [0, 996]


def test_a_header_repeated_inside_a_csv_is_refused_not_read_as_a_row(tmp_path):
    """`cat train.csv val.csv > all.csv` keeps val's header as a row: 'sequence' reads as the protein SEQUENCE and
    the label column's name became a class of its own (the sanity task's charge_class gave 4 classes, not 3)."""
    rows = [{"id": "p1", "sequence": "MKTAYIAK", "c": "b"}, {"id": "p2", "sequence": "LLGV", "c": "a"}]
    joined = tmp_path / "joined.csv"
    joined.write_text(write(tmp_path / "a.csv", rows).read_text() * 2)
    with pytest.raises(DataError, match=r"joined.csv: row 4 repeats the header \(files joined with their headers"):
        read(joined, Task.classification, ("c",))


def test_a_quote_left_open_in_a_class_column_is_refused_not_read_as_one_row(tmp_path):
    """A label `"basic` whose quote is never closed took every row after it into one field: 4 rows were read as 1,
    of one class named by the rest of the file. A class name holding a line break is refused, naming the row."""
    (tmp_path / "open.csv").write_text('id,sequence,c\np1,MKV,"basic\np2,LLA,acidic\np3,MKK,basic\np4,AAA,acidic\n')
    with pytest.raises(DataError, match=r"open.csv: row 2, column 'c': 'basic\\np2,LLA,acidic.*a quote left open"):
        read(tmp_path / "open.csv", Task.classification, ("c",))
