"""Which files a `data.path` names, and (name, sequence) records read from them.

A path is a file, a folder (walked in name order; a `datasets` save_to_disk folder inside it is read through its
state.json, so its cache files and other splits are not), or a glob pattern (`/data/hub/data/train-*.parquet`).
Files: FASTA (.fasta .fa .faa .fas), parquet, CSV/TSV, Arrow (the IPC stream files `datasets` writes, or IPC
files: Feather v2); FASTA and CSV/TSV may be compressed (.gz .bz2 .xz .zst). Nucleotide FASTA (NCBI's .fna .ffn
.frn) is not protein: a folder skips it, a path naming it is refused. Anything a user would lose silently is
refused with the file named instead: a file of a known kind in an unreadable compression, the same file twice
(x.fasta and x.fasta.gz), a folder whose file names mark several splits (Hugging Face's train/validation/test
naming), a damaged or truncated file, a `datasets` folder whose JSON files are not of the shape `datasets` writes.
Each refusal is a DataError naming the setting that gave the path (`SourceKeys`: data.path, data.val_path,
predict.folder, preprocess's --input).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import lzma
import os
import re
import stat
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Iterator, Optional, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from core.config.errors import DataError
from core.config.file_shape import problems, read_small_file
from core.data.arrow_ipc import IpcLayoutError, batch_bytes
from core.data.bounded_stream import BoundedReader
from core.data.folder_walk import walk
from core.data.parquet_text import MAX_EXPANSION, MIN_BUDGET_BYTES, text_batches
from core.data.text_lines import bounded_lines

FASTA_SUFFIXES = (".fasta", ".fa", ".faa", ".fas")
NUCLEOTIDE_SUFFIXES = (".fna", ".ffn", ".frn")
TABLE_SUFFIXES = (".parquet", ".csv", ".tsv")
ARROW_SUFFIXES = (".arrow", ".feather")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}  # for FASTA and CSV/TSV
UNREADABLE_COMPRESSIONS = (".zip", ".7z", ".rar", ".lz4", ".br", ".snappy", ".zstd", ".lzma", ".z")
# Hugging Face datasets' split keywords in file and folder names (data/train-00000-of-00002.parquet, test/x.csv)
_SPLIT_WORDS = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
    "testing": "test",
    "eval": "test",
    "evaluation": "test",
}
_SPLIT_PATTERN = re.compile(
    r"(?:^|[\s\-_./])(" + "|".join(sorted(_SPLIT_WORDS, key=len, reverse=True)) + r")(?=[\s\-_./0-9]|$)"
)
_GLOB_CHARACTERS = re.compile(r"[*?\[]")
_DIGIT = re.compile(r"\d")
MAX_JSON_BYTES = 16 << 20  # a datasets folder's state.json lists its files; a store's index.json is some 500 bytes
# The longest known proteins have ~35,000 residues; a FASTA line or record far beyond that is not protein data (a
# file with no line ends, a decompression bomb) and is refused before it fills memory.
MAX_SEQUENCE_LENGTH = 1 << 20


@dataclass(frozen=True)
class SourceKeys:
    """The settings (or command-line options) that gave a read its path, column and split, so that a message
    names what the user set: `data.path=/x`, `data.val_path=/x`, `predict.folder=/x`, `--input /x`."""

    path: str = "data.path"
    column: str = "data.column"
    split: str = "data.split"

    def of(self, key: str, value: object) -> str:
        setting = getattr(self, key)
        return f"{setting} {value}" if setting.startswith("-") else f"{setting}={value}"


DATA_PATH = SourceKeys()
RESAVE = "save the dataset again with `datasets`' save_to_disk"
Model = TypeVar("Model", bound=BaseModel)


def read_json_file(file: Path, model: type[Model], named: str, remedy: str) -> Model:
    """A small JSON file checked against `model`; DataError naming it (after `named`, e.g. `data.path=/x`) and
    `remedy` if it is missing, not a small regular file, not UTF-8 JSON or of another shape."""
    try:
        return model.model_validate_json(read_small_file(file, MAX_JSON_BYTES, follow_symlinks=True), strict=True)
    except ValidationError as e:
        problem = problems(e)
    except (OSError, ValueError) as e:  # missing, unreadable, a FIFO, too large
        problem = getattr(e, "strerror", None) or str(e)
    raise DataError(f"{named}: {file} is not what this recipe reads ({problem}); {remedy}")


def _split_suffix(name: str) -> tuple[str, str]:
    """(the name without its compression suffix, that suffix or "")."""
    lower = name.lower()
    for suffix in (*COMPRESSIONS, *UNREADABLE_COMPRESSIONS):
        if lower.endswith(suffix):
            return lower[: -len(suffix)], suffix
    return lower, ""


def file_kind(path: Path) -> tuple[Optional[str], Optional[str]]:
    """(kind, why it cannot be read): kind is fasta, nucleotide, parquet, csv or arrow, or None for a file that
    is not sequence data; the reason is set for a sequence file this reader cannot open."""
    base, compression = _split_suffix(path.name)
    if base.endswith(FASTA_SUFFIXES):
        kind = "fasta"
    elif base.endswith(NUCLEOTIDE_SUFFIXES):
        kind = "nucleotide"
    elif base.endswith(".parquet"):
        kind = "parquet"
    elif base.endswith((".csv", ".tsv")):
        kind = "csv"
    elif base.endswith(ARROW_SUFFIXES):
        kind = "arrow"
    else:
        return None, None
    if compression and (compression not in COMPRESSIONS or kind in ("parquet", "arrow")):
        return kind, (
            f"{compression} compression is not read here (FASTA and CSV/TSV: "
            f"{' '.join(COMPRESSIONS)}; parquet and Arrow compress inside the file): decompress it"
        )
    return kind, None


def _is_datasets_folder(folder: Path) -> bool:
    return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


def _file_in_folder(name: str) -> str:
    if name in ("", ".", "..") or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ValueError("should be the name of a file in the folder (no '/', no leading '.')")
    return name


class DatasetDictFile(BaseModel):
    """dataset_dict.json of a `datasets` DatasetDict folder: the names of its splits (a folder each)."""

    model_config = ConfigDict(strict=True)
    splits: Annotated[list[Annotated[str, AfterValidator(_file_in_folder)]], Field(min_length=1)]


class DataFileEntry(BaseModel):
    filename: Annotated[str, AfterValidator(_file_in_folder)]


class DatasetStateFile(BaseModel):
    """state.json of a `datasets` Dataset folder: its Arrow files (not the cache files `.map()` leaves beside)."""

    model_config = ConfigDict(strict=True)
    data_files: Annotated[list[DataFileEntry], Field(alias="_data_files", min_length=1)]


def datasets_folder_files(path: Path, split: str, keys: SourceKeys = DATA_PATH) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk folder: a Dataset's, or a DatasetDict's `split`'s (the ones
    its state.json lists: not the cache files `.map()` leaves beside them)."""
    named = keys.of("path", path)
    if (path / "dataset_dict.json").exists():
        splits = read_json_file(path / "dataset_dict.json", DatasetDictFile, named, RESAVE).splits
        if split not in splits:
            raise DataError(f"{keys.of('split', split)}: {path} is a DatasetDict of splits {splits}")
        path = path / split
    state = read_json_file(path / "state.json", DatasetStateFile, named, RESAVE)
    return [path / entry.filename for entry in state.data_files]


def source_files(path: Path, split: str = "train", keys: SourceKeys = DATA_PATH) -> list[Path]:
    """The sequence files `path` names, in reading order (see the module's docstring for what is refused)."""
    if _GLOB_CHARACTERS.search(str(path)) and not path.exists():
        matches = sorted(Path(p) for p in glob.glob(str(path)))
        if not matches:
            raise DataError(f"{keys.of('path', path)}: the pattern matches nothing")
        files = [f for match in matches for f in source_files(match, split, keys)]
        repeated = sorted(str(f) for f, n in Counter(files).items() if n > 1)
        if repeated:
            raise DataError(f"{keys.of('path', path)}: the pattern names these files twice: {', '.join(repeated)}")
        return files
    if path.is_file():
        kind, problem = file_kind(path)
        if kind is None:
            raise DataError(
                f"{keys.of('path', path)}: not a sequence file (FASTA {' '.join(FASTA_SUFFIXES)}, parquet, "
                f"CSV/TSV, Arrow; FASTA and CSV/TSV optionally {' '.join(COMPRESSIONS)}), nor a folder"
            )
        if kind == "nucleotide":
            raise DataError(
                f"{keys.of('path', path)}: {path.suffix} is NCBI's suffix for nucleotide FASTA; this recipe "
                "reads protein sequences (rename the file .fasta if it holds proteins)"
            )
        if problem:
            raise DataError(f"{keys.of('path', path)}: {problem}")
        return [path]
    if not path.is_dir():
        raise DataError(f"{keys.of('path', path)}: no such file or folder")
    files, unreadable, nucleotide = [], [], []
    _walk(path, split, keys, files, unreadable, nucleotide)
    if unreadable:
        raise DataError(
            f"{keys.of('path', path)}: cannot read "
            + "; ".join(f"{f} ({why})" for f, why in unreadable[:5])
            + (f"; and {len(unreadable) - 5} more" if len(unreadable) > 5 else "")
        )
    if not files:
        raise DataError(
            f"{keys.of('path', path)}: no sequence files in this folder (FASTA {' '.join(FASTA_SUFFIXES)}, "
            f"parquet, CSV/TSV, Arrow, a `datasets` save_to_disk folder)"
            + (f"; {len(nucleotide)} nucleotide FASTA files skipped" if nucleotide else "")
        )
    _refuse_doubles(path, files, keys)
    _refuse_mixed_splits(path, files, keys)
    return files


def _walk(folder: Path, split: str, keys: SourceKeys, files: list, unreadable: list, nucleotide: list) -> None:
    """The sequence files under `folder` in path order, links to folders followed, each real folder once
    (core/data/folder_walk.py: a link loop is named in a warning, never followed twice); a `datasets`
    save_to_disk folder is read through its own state.json."""
    found: list[tuple[Path, list[Path]]] = []  # (where it sorts, its files in their order)
    for current, names in walk(folder, stop=_is_datasets_folder):
        if not names and _is_datasets_folder(current):
            found.append((current, datasets_folder_files(current, split, keys)))
            continue
        for name in names:
            entry = current / name
            kind, problem = file_kind(entry)
            if kind == "nucleotide":
                nucleotide.append(entry)
            elif problem:
                unreadable.append((entry, problem))
            elif kind is not None and entry.is_file():
                found.append((entry, [entry]))
    files.extend(f for _, group in sorted(found, key=lambda item: item[0]) for f in group)


def _refuse_doubles(root: Path, files: list[Path], keys: SourceKeys) -> None:
    seen: dict[tuple[Path, str], Path] = {}
    for f in files:
        key = (f.parent, _split_suffix(f.name)[0])
        if key in seen:
            raise DataError(
                f"{keys.of('path', root)}: {seen[key].name} and {f.name} in {f.parent} look like one file "
                "twice: keep one"
            )
        seen[key] = f


def _refuse_mixed_splits(root: Path, files: list[Path], keys: SourceKeys) -> None:
    marked: dict[str, Path] = {}
    for f in files:
        match = _SPLIT_PATTERN.search(f.relative_to(root).as_posix().lower())
        if match:
            marked.setdefault(_SPLIT_WORDS[match.group(1)], f)
    if len(marked) > 1:
        examples = ", ".join(f"{s}: {f.relative_to(root)}" for s, f in marked.items())
        raise DataError(
            f"{keys.of('path', root)}: its files belong to several splits by their names ({examples}); "
            f"point {keys.path} at one split's files (a folder, a file or a pattern such as "
            f"{root}/data/train-*.parquet)"
            + (" and data.val_path at the validation split's" if keys.path == "data.path" else "")
        )


def records(
    path: Path, column: str, name_column: Optional[str], split: str, keys: SourceKeys = DATA_PATH
) -> Iterator[tuple[str, str]]:
    """(name, sequence) from every file `path` names, in order; a file that cannot be read is named, after the
    setting that gave it (`keys`)."""
    for file in source_files(path, split, keys):
        _refuse_unless_regular(file, keys)
        try:
            if file_kind(file)[0] == "fasta":
                yield from read_fasta(file, keys)
            else:
                yield from read_table(file, column, name_column, keys)
        except DataError:
            raise
        except Exception as e:
            if isinstance(e, (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)) or type(
                e
            ).__module__.startswith("pyarrow"):
                raise DataError(f"{keys.of('path', file)}: unreadable ({type(e).__name__}: {e})") from e
            raise


def _refuse_unless_regular(file: Path, keys: SourceKeys) -> None:
    """A FIFO would block its reader and a device (a link to /dev/zero) never end: any file to read must be a
    regular one, also those a `datasets` folder's state.json names."""
    try:
        mode = os.stat(file).st_mode
    except OSError as e:
        raise DataError(f"{keys.of('path', file)}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise DataError(f"{keys.of('path', file)}: not a regular file (a FIFO, a device or a folder): not read")


def _open_bytes(path: Path, keys: SourceKeys) -> IO[bytes]:
    """The bytes of a FASTA or CSV/TSV file, decompressed by its name, held to parquet's bound on expansion
    (core/data/parquet_text.py): a bound on each line does not stop a few KB of bz2 that hold gigabytes of short
    lines, all held in memory when read for training."""
    compression = _split_suffix(path.name)[1]
    if not compression:
        return open(path, "rb")
    if compression == ".zst":
        import pyarrow as pa

        raw = pa.input_stream(str(path), compression="zstd")
    else:
        raw = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[compression](path, "rb")
    size = path.stat().st_size
    limit = max(MIN_BUDGET_BYTES, MAX_EXPANSION * size)

    def too_much() -> DataError:
        return DataError(
            f"{keys.of('path', path)}: decompresses to more than {limit} bytes, the bound for a file of {size} "
            f"bytes ({MAX_EXPANSION} times its size, at least {MIN_BUDGET_BYTES}): a decompression bomb? not read"
        )

    return io.BufferedReader(BoundedReader(raw, limit, too_much))


def _open_text(path: Path, keys: SourceKeys) -> io.TextIOBase:
    """A text reader of a (possibly compressed) file; a byte-order mark is dropped, bytes that are not UTF-8 become
    U+FFFD (and so <unk>)."""
    return io.TextIOWrapper(_open_bytes(path, keys), encoding="utf-8-sig", errors="replace")


def read_fasta(path: Path, keys: SourceKeys = DATA_PATH) -> Iterator[tuple[str, str]]:
    """(name, sequence) per record: the header's first word (after '>'), the sequence lines joined. Blank lines
    and ';' comment lines are skipped; text before the first header, a digit in a sequence line (a header that
    lost its '>'), or a line or sequence longer than MAX_SEQUENCE_LENGTH is an error naming the line."""
    name, parts, length, line_number = None, [], 0, 0

    def refuse(line_number: int, problem: str) -> DataError:
        return DataError(f"{keys.of('path', path)}:{line_number}: {problem}")

    def too_long(line_number: int) -> DataError:
        return refuse(line_number, f"a line longer than {MAX_SEQUENCE_LENGTH} characters: not protein FASTA")

    with _open_text(path, keys) as f:
        for line_number, line in enumerate(bounded_lines(f, MAX_SEQUENCE_LENGTH, too_long), 1):
            line = line.strip()
            if not line or line.startswith(";"):
                continue
            if line.startswith(">"):
                if name is not None:
                    yield name, "".join(parts)
                header = line[1:].split()
                name, parts, length = (header[0] if header else ""), [], 0
            elif name is None:
                raise refuse(line_number, "sequence text before the first '>' header: not FASTA")
            elif _DIGIT.search(line):
                raise refuse(line_number, f"a digit in a sequence line ({line[:40]!r}): a header that lost its '>'?")
            else:
                parts.append(line)
                length += len(line)
                if length > MAX_SEQUENCE_LENGTH:
                    raise refuse(
                        line_number,
                        f"sequence {name!r} is longer than {MAX_SEQUENCE_LENGTH} residues: not one protein "
                        "(headers lost?)",
                    )
    if name is not None:
        yield name, "".join(parts)


def _csv_batches(path: Path, column: str, name_column: Optional[str], keys: SourceKeys) -> tuple[list[str], Iterator]:
    """(the header's column names, the batches of the two columns read, as text, opened when first iterated): the
    other columns are not read, so a column that changes type halfway down the file refuses nothing."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    def open_csv(convert: pacsv.ConvertOptions):
        tsv = _split_suffix(path.name)[0].endswith(".tsv")
        compressed = _split_suffix(path.name)[1]  # an uncompressed file: pyarrow's own reader, by its path
        return pacsv.open_csv(
            _open_bytes(path, keys) if compressed else path,
            parse_options=pacsv.ParseOptions(delimiter="\t" if tsv else ","),
            convert_options=convert,
        )

    read = [column] + ([name_column] if name_column else [])
    with open_csv(pacsv.ConvertOptions(column_types=dict.fromkeys(read, pa.string()))) as header_reader:
        columns = header_reader.schema.names

    def batches():
        present = [c for c in dict.fromkeys(read) if c in columns]
        yield from open_csv(
            pacsv.ConvertOptions(column_types=dict.fromkeys(present, pa.string()), include_columns=present)
        )

    return columns, batches()


def _arrow_stream(path: Path):
    """The memory-mapped file at the start of its IPC stream: the whole file (what `datasets.save_to_disk`
    writes), or an IPC file's (Feather v2) stream after its magic, which holds the batches its footer lists. Read
    as a stream, the batches read are the ones checked, whatever a footer says."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    if source.read(8)[:6] != b"ARROW1":
        source.seek(0)
    return source


def _arrow_reader(path: Path, keys: SourceKeys):
    """An Arrow file's batch reader, once its batches' decompressed size is known to be within the parquet bound
    (core/data/parquet_text.py): a compressed buffer (LZ4, ZSTD) is expanded whole when its batch is read, and a
    few hundred KB can hold gigabytes of one repeated sequence."""
    import pyarrow as pa

    budget, expanded = max(MIN_BUDGET_BYTES, MAX_EXPANSION * path.stat().st_size), 0
    try:
        for message in pa.ipc.MessageReader.open_stream(_arrow_stream(path)):
            body = message.body if message.body is not None else b""
            expanded += batch_bytes(message.metadata.to_pybytes(), body)
            if expanded > budget:
                raise DataError(
                    f"{keys.of('path', path)}: its batches decompress to more than {budget} bytes, the bound for a "
                    f"file of {path.stat().st_size} bytes ({MAX_EXPANSION} times its size, at least "
                    f"{MIN_BUDGET_BYTES}): a decompression bomb? not read"
                )
    except IpcLayoutError as e:
        raise DataError(f"{keys.of('path', path)}: unreadable (a damaged batch header: {e})") from None
    return pa.ipc.open_stream(_arrow_stream(path))


def read_table(
    path: Path, column: str, name_column: Optional[str], keys: SourceKeys = DATA_PATH
) -> Iterator[tuple[str, str]]:
    """(name, sequence) per row of a parquet, CSV or TSV file, or an Arrow file, read in batches; both columns are
    read as text; a missing or null name gives the row number, a missing sequence column is an error naming the
    columns."""
    import pyarrow.parquet as pq

    kind = file_kind(path)[0]
    if kind == "parquet":
        parquet = pq.ParquetFile(path)
        columns, batches = parquet.schema_arrow.names, None
    elif kind == "csv":
        columns, batches = _csv_batches(path, column, name_column, keys)
    else:  # arrow: an IPC stream (what `datasets.save_to_disk` writes) or an IPC file (Feather v2)
        reader = _arrow_reader(path, keys)
        columns, batches = reader.schema.names, reader
    if column not in columns:
        raise DataError(f"{keys.of('column', column)}: {path} has no such column (it has {', '.join(columns)})")
    for wanted in (column, name_column):
        if columns.count(wanted) > 1:
            raise DataError(f"{keys.of('path', path)}: {columns.count(wanted)} columns are named {wanted!r}: keep one")
    use_names = name_column is not None and name_column in columns
    if kind == "parquet":  # a batch at a time, bounded: a repeated value is stored once and may expand far
        batches = text_batches(path, [column] + ([name_column] if use_names else []), MAX_SEQUENCE_LENGTH)
    row = 0
    for batch in batches:
        if kind == "arrow":  # read as stored: offsets past their data (damaged, crafted) would crash the reader
            batch.validate(full=True)
        sequences = batch.column(column).to_pylist()
        names = batch.column(name_column).to_pylist() if use_names else [None] * len(sequences)
        for name, sequence in zip(names, sequences):
            if sequence is not None and not isinstance(sequence, str):
                raise DataError(
                    f"{keys.of('column', column)}: {path} row {row}: expected text, got {type(sequence).__name__}"
                )
            if kind == "csv" and sequence == column and (not use_names or name == name_column):
                # CSV files joined with their headers: "sequence" reads as a protein, SEQUENCE
                raise DataError(
                    f"{keys.of('path', path)}: row {row + 2} repeats the header (row 1; files joined?): remove it"
                )
            yield (str(row) if name is None else str(name)), sequence or ""
            row += 1
