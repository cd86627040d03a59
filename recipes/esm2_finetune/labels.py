"""Labelled protein sequences from the files people keep them in, every label checked before any work.

Formats by extension: .csv and .tsv (Python's csv module: quoted fields, CRLF line ends, a UTF-8 byte-order mark),
.parquet (pyarrow, read a batch at a time, only the columns needed), .jsonl / .json (JSON Lines: one object per
line). Nothing is evaluated: CSV fields are text, JSON is parsed by the json module. A file is read once, streaming:
each row's residues and labels go straight into compact arrays (a huge file is never held as Python rows).

A problem is a DataError naming the setting and file, the row and the column: CSV/TSV rows are numbered as a
spreadsheet shows them (the header is row 1), JSON Lines by line number, parquet rows from 1. What is refused: a
missing column or value, a regression label that is not a finite number, a multilabel value that is not 0/1/true/
false, a class not in model.classes (when given) or holding a line break (a CSV quote left open), residue labels of
another length than the sequence, an empty sequence, a character that is not an amino-acid letter, a sequence of
nucleotide letters only (DNA or RNA?), a split column value other than train / val / test, a CSV row that repeats
the header (files joined with their headers: 'sequence' reads as a protein, a label column's name as a class).
Duplicate ids are fine (they are names, not keys).
"""

from __future__ import annotations

import array
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from core.config.errors import DataError
from core.data.json_lines import json_lines
from core.data.parquet_text import TextRefused, text_batches
from core.data.text_lines import bounded_lines
from recipes.esm2.tokenizer import UNK, encode_residues
from recipes.esm2_finetune.config import Task

FORMATS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
SPLITS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
UNLABELLED = -1  # a residue without a label (null in a list of residue labels): no loss there
NUCLEOTIDE_CHECK_LENGTH = 30  # a protein this long made only of A C G T U N is vanishingly unlikely
_NUCLEOTIDES = set("ACGTUN")
_TRUE, _FALSE = {"1", "1.0", "true", "yes"}, {"0", "0.0", "false", "no"}
MAX_LINE_CHARACTERS = 64 << 20  # a CSV line or field: a long sequence and its residue labels fit many times
csv.field_size_limit(MAX_LINE_CHARACTERS)  # a long sequence or residue-label string is one field (default: 128 KiB)
# What pandas and R write for a missing value: never a class name (NaN in JSON is a float, caught apart)
_MISSING_WORDS = {"na", "n/a", "nan", "null", "none", "<na>", "#n/a"}


@dataclass(frozen=True)
class LabelSpec:
    """What to read: the task, its label columns and classes (None: the sorted ones found), the other columns."""

    task: Task
    label_columns: tuple[str, ...]
    classes: Optional[tuple[str, ...]] = None
    sequence_column: str = "sequence"
    id_column: str = "id"
    split_column: Optional[str] = None
    labels_required: bool = True  # False (predict.py): a file without the label columns reads as unlabelled


@dataclass
class LabelledSequences:
    """Sequences (token ids, no <cls>/<eos>) and their labels, in file order. `targets`: regression float64 [N, K],
    multilabel float32 [N, K] (0/1), classification int64 [N] (class index), residue_classification int16 [residues]
    aligned with `residues` (UNLABELLED where none); None for a file without labels."""

    source: str
    ids: list[str]
    residues: np.ndarray
    offsets: np.ndarray
    targets: Optional[np.ndarray]
    classes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths_of(self, indices: np.ndarray) -> np.ndarray:
        return self.offsets[indices + 1] - self.offsets[indices]

    def sequence(self, i: int) -> np.ndarray:
        return self.residues[self.offsets[i] : self.offsets[i + 1]]

    def name(self, i: int) -> str:
        return self.ids[i]


class Refusal(Exception):
    """A problem with one value; the reader adds the file, row and column (`column`: a label column's name)."""

    column: Optional[str] = None


@dataclass
class _Builder:
    """One split's arrays while reading; class codes are provisional (first seen) until `finish` sorts them."""

    ids: list = field(default_factory=list)
    residues: bytearray = field(default_factory=bytearray)
    lengths: array.array = field(default_factory=lambda: array.array("q"))
    values: array.array = field(default_factory=lambda: array.array("d"))
    codes: array.array = field(default_factory=lambda: array.array("q"))
    labelled: bool = True


class Classes:
    """Class names -> codes: the given ones, or each new one numbered as first seen (sorted by `order`)."""

    def __init__(self, given: Optional[tuple[str, ...]]):
        self.given = given is not None
        self.index = {name: i for i, name in enumerate(given or ())}

    def code(self, name: str) -> int:
        if name not in self.index:
            if self.given:
                raise Refusal(f"class {name!r} is not one of model.classes={list(self.index)}")
            self.index[name] = len(self.index)
        return self.index[name]

    def order(self) -> tuple[tuple[str, ...], np.ndarray]:
        """(the classes in index order, provisional code -> final code)."""
        names = list(self.index)
        if self.given:
            return tuple(names), np.arange(len(names))
        numeric = all(_is_int(n) for n in names)
        ordered = sorted(names, key=(lambda n: (int(n), n)) if numeric else None)
        remap = np.empty(len(names), dtype=np.int64)
        for final, name in enumerate(ordered):
            remap[self.index[name]] = final
        return tuple(ordered), remap


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def read_labelled(path: str | Path, setting: str, spec: LabelSpec) -> dict[str, LabelledSequences]:
    """The labelled sequences of `path` (which `setting` gave: data.train_path, ...) by split: {"all": ...}, or with
    spec.split_column {"train": ..., "val": ..., "test": ...} (the splits present). Refuses the first problem."""
    path = Path(path)
    source = f"{setting}={path}"
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{source}: expected a .csv, .tsv, .parquet or .jsonl file (labelled sequences)")
    if not path.is_file():
        raise DataError(f"{source}: no such file")
    classes = Classes(spec.classes)
    builders: dict[str, _Builder] = {}
    wanted = [spec.sequence_column, *spec.label_columns] + ([spec.split_column] if spec.split_column else [])
    rows = {"csv": _csv_rows, "parquet": _parquet_rows, "jsonl": _jsonl_rows}[kind](path, source, wanted, spec)
    for where, row in rows:
        column = spec.sequence_column
        try:
            split = _split_of(row, spec)
            builder = builders.setdefault(split, _Builder(labelled=spec.label_columns[0] in row))
            ids = _residue_ids(row.get(spec.sequence_column))
            if builder.labelled:
                _add_labels(builder, row, spec, classes, len(ids))
        except Refusal as e:
            column = e.column or column
            raise DataError(f"{source}: {where[0]} {where[1]}, column {column!r}: {e}") from None
        name = row.get(spec.id_column)
        builder.ids.append(str(where[1]) if name is None or name == "" else str(name))
        builder.residues += ids.tobytes()
        builder.lengths.append(len(ids))
    if not builders:
        raise DataError(f"{source}: no rows")
    names, remap = classes.order()
    twice = None if classes.given else _one_number_twice(names)
    if twice:
        raise DataError(f"{source}: the classes {twice[0]!r} and {twice[1]!r} are one number written two ways")
    return {split: _finish(b, source, spec, names, remap) for split, b in builders.items()}


def _one_number_twice(names: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """Two class names that are the same number (1, 1.0, 01): one class in the data's meaning, two in the head's."""
    seen: dict[float, str] = {}
    for name in names:
        try:
            value = float(name)
        except ValueError:
            continue
        if value in seen:
            return seen[value], name
        seen[value] = name
    return None


def _split_of(row: dict, spec: LabelSpec) -> str:
    if spec.split_column is None:
        return "all"
    value = row.get(spec.split_column)
    split = SPLITS.get(str(value).strip().lower()) if value is not None else None
    if split is None:
        raise Refusal(f"split {value!r}: expected train, val (valid, validation) or test")
    return split


def _residue_ids(value: Any) -> np.ndarray:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise Refusal("no sequence (an empty value)")
    if not isinstance(value, str):
        raise Refusal(f"{value!r} is not a sequence of residue letters")
    letters = "".join(value.split())
    gap = next((i for i, c in enumerate(letters) if c in "-."), None)  # tokens of ESM's vocabulary, not residues
    if gap is not None:
        raise Refusal(f"{letters[gap]!r} at residue {gap + 1} is an alignment gap, not a residue: remove the gaps")
    ids = encode_residues(letters)
    unknown = np.flatnonzero(ids == UNK)
    if len(unknown):
        raise Refusal(f"{letters[unknown[0]]!r} at residue {unknown[0] + 1} is not an amino-acid letter")
    if len(letters) >= NUCLEOTIDE_CHECK_LENGTH and set(letters.upper()) <= _NUCLEOTIDES:
        raise Refusal("a sequence of nucleotide letters only (ACGTUN): DNA or RNA, not protein?")
    return ids


def _add_labels(builder: _Builder, row: dict, spec: LabelSpec, classes: Classes, length: int) -> None:
    """Append the row's labels (Refusal naming the column on a bad value)."""
    for column in spec.label_columns:
        try:
            _add_label(builder, row.get(column), spec, classes, length)
        except Refusal as e:
            e.column = column
            raise


def _add_label(builder: _Builder, value: Any, spec: LabelSpec, classes: Classes, length: int) -> None:
    if spec.task is Task.residue_classification:
        labels = _residue_labels(value, length)
        builder.codes.extend(UNLABELLED if name is None else classes.code(name) for name in labels)
    elif _missing(value):
        raise Refusal("no label (an empty value)")
    elif spec.task is Task.regression:
        builder.values.append(_number(value))
    elif spec.task is Task.multilabel:
        builder.values.append(_yes_no(value))
    else:
        name = _class_name(value)
        if name.lower() in _MISSING_WORDS and name not in (spec.classes or ()):  # model.classes may name it
            raise Refusal(f"{value!r} reads as a missing label (what pandas or R write for one)")
        builder.codes.append(classes.code(name))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or _is_nan(value)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise Refusal(f"{value!r} is not a number")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        raise Refusal(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise Refusal(f"{value!r} is not a finite number")
    return number


def _yes_no(value: Any) -> float:
    text = str(value).strip().lower() if not isinstance(value, (list, dict)) else ""
    if text in _TRUE or text in _FALSE:
        return 1.0 if text in _TRUE else 0.0
    raise Refusal(f"{value!r} is not a yes/no label (0 or 1, true or false)")


def _class_name(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        raise Refusal(f"{value!r} is not a class name")
    name = str(value).strip()
    if "\n" in name or "\r" in name:  # a CSV quote left open takes the rows after it into one field
        raise Refusal(f"{name[:60]!r}... holds a line break: a quote left open took in the rows after it?")
    return name


def _residue_labels(value: Any, length: int) -> list[Optional[str]]:
    """A string of one-character labels, names separated by spaces, or a list (None: unlabelled residue)."""
    if _missing(value):
        raise Refusal("no residue labels (an empty value)")
    if isinstance(value, str):
        labels = value.split() if len(value.split()) > 1 else list(value.strip())
    elif isinstance(value, (list, tuple, np.ndarray)):
        labels = [None if v is None or _is_nan(v) else _class_name(v) for v in value]
    else:
        raise Refusal(f"{value!r} is not a string or list of residue labels")
    if len(labels) != length:
        raise Refusal(f"{len(labels)} residue labels for a sequence of {length} residues")
    return labels


def _finish(builder: _Builder, source: str, spec: LabelSpec, classes: tuple, remap: np.ndarray) -> LabelledSequences:
    offsets = np.zeros(len(builder.lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(builder.lengths, dtype=np.int64), out=offsets[1:])
    residues = np.frombuffer(bytes(builder.residues), dtype=np.uint8)
    n, k = len(builder.ids), len(spec.label_columns)
    targets, task = None, spec.task
    if builder.labelled:
        if task is Task.regression:
            targets = np.frombuffer(builder.values, dtype=np.float64).reshape(n, k).copy()
        elif task is Task.multilabel:
            targets = np.frombuffer(builder.values, dtype=np.float64).reshape(n, k).astype(np.float32)
        else:
            codes = np.frombuffer(builder.codes, dtype=np.int64)
            mapped = np.where(codes >= 0, remap[np.maximum(codes, 0)] if len(remap) else codes, codes)
            targets = mapped.astype(np.int16 if task is Task.residue_classification else np.int64)
    if task in (Task.regression, Task.multilabel):
        classes = tuple(spec.label_columns)
    return LabelledSequences(source, builder.ids, residues, offsets, targets, classes)


# --- the formats: (where, row) with where = ("row" | "line", number) and row = {column: value} ---------------
def _check_header(columns: list[str], source: str, wanted: list[str], spec: LabelSpec) -> None:
    labels = set(spec.label_columns)
    present = [c for c in spec.label_columns if c in columns]
    for column in wanted:
        if column in columns or (column in labels and not spec.labels_required and not present):
            continue
        raise DataError(f"{source}: no column {column!r} (its columns: {', '.join(map(repr, columns))})")


def _csv_rows(path: Path, source: str, wanted: list[str], spec: LabelSpec) -> Iterator[tuple[tuple, dict]]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(
                bounded_lines(f, MAX_LINE_CHARACTERS, lambda n: _too_long(source, n)), delimiter=delimiter
            )
            header = next(reader, None)
            if header is None:
                raise DataError(f"{source}: an empty file (expected a header row naming the columns)")
            header = [h.strip() for h in header]
            repeated = sorted(c for c in set(header) if header.count(c) > 1 and c in [*wanted, spec.id_column])
            if repeated:
                raise DataError(f"{source}: the header names {', '.join(map(repr, repeated))} more than once: keep one")
            _check_header(header, source, wanted, spec)
            for number, fields in enumerate(reader, start=2):
                if not any(f.strip() for f in fields):
                    continue  # a blank line
                if len(fields) > len(header):
                    raise DataError(f"{source}: row {number} has {len(fields)} fields, the header {len(header)}")
                if [f.strip() for f in fields] == header:  # "sequence" is a protein, a label column's name a class
                    raise DataError(
                        f"{source}: row {number} repeats the header (files joined with their headers?): remove it"
                    )
                yield ("row", number), dict(zip(header, fields))
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{source}: not a readable CSV/TSV file ({e})") from None


def _too_long(source: str, line: int) -> DataError:
    return DataError(f"{source}: line {line} is longer than {MAX_LINE_CHARACTERS >> 20} Mi characters (no line end?)")


def _parquet_rows(path: Path, source: str, wanted: list[str], spec: LabelSpec) -> Iterator[tuple[tuple, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
        _check_header(names, source, wanted, spec)
        columns = [c for c in dict.fromkeys([*wanted, spec.id_column]) if c in names]
        number = 0
        for batch in text_batches(path, columns, MAX_LINE_CHARACTERS):  # bounded: a repeated value may expand far
            for row in batch.to_pylist():
                number += 1
                yield ("row", number), row
    except TextRefused as e:
        raise DataError(f"{source}: {e}") from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{source}: not a readable parquet file ({e})") from None


def _jsonl_rows(path: Path, source: str, wanted: list[str], spec: LabelSpec) -> Iterator[tuple[tuple, dict]]:
    for number, row in json_lines(path, source):
        if not isinstance(row, dict):
            raise DataError(f"{source}: line {number} is not a JSON object (expected one per line)")
        for column in wanted:
            if column not in row and (spec.labels_required or column not in spec.label_columns):
                raise DataError(f"{source}: line {number} has no {column!r}")
        yield ("line", number), row
