"""Protein sequences from the files people keep them in, as one array of residue tokens and their offsets.

Sources (`read_store`): FASTA (.fasta .fa .faa .fas .fna, optionally .gz), parquet and CSV/TSV (one column of
sequences, optionally one of names), a Hugging Face `datasets` folder written by `save_to_disk` (its Arrow
files, read with pyarrow: no `datasets` import), a folder of any of these, or a folder written by
`python -m recipes.esm2.preprocess` (`write_store`): the same arrays on disk, memory-mapped, so a run over
100M+ sequences starts at once and every process shares the pages.

A store is two arrays, `residues` (uint8 token ids, every sequence's residues one after another, no <cls>/<eos>)
and `offsets` (int64, sequence i is residues[offsets[i]:offsets[i+1]]), and the sequences' names. That is what
keeps resume exact: sequence i is the same tokens in every process and every run.
"""

from __future__ import annotations

import array
import gzip
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from core.checkpointing.hf_folders import read_json_object
from core.config.errors import ConfigError
from recipes.esm2.tokenizer import encode_residues

FASTA_SUFFIXES = (".fasta", ".fa", ".faa", ".fas", ".fna")
TABLE_SUFFIXES = (".parquet", ".csv", ".tsv")
STORE_INDEX = "index.json"
STORE_VERSION = 1


@dataclass
class SequenceStore:
    residues: np.ndarray  # uint8 [total residues]
    offsets: np.ndarray  # int64 [sequences + 1]
    names: Optional[list[str]]  # one per sequence, or None (a preprocessed store reads them on demand)
    source: str
    names_file: Optional[Path] = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int) -> np.ndarray:
        return self.residues[self.offsets[i]:self.offsets[i + 1]]

    def name(self, i: int) -> str:
        if self.names is None and self.names_file is not None:
            self.names = self.names_file.read_text(encoding="utf-8").split("\n")[: len(self)]
        return self.names[i] if self.names is not None else str(i)


def source_files(path: Path) -> list[Path]:
    """The sequence files a path names: itself, or the readable files of a folder (sorted; other files are
    skipped, hidden ones too)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"data.path={path}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(path).parts)
                   and _kind(p) is not None)
    if not files:
        raise ConfigError(f"data.path={path}: no sequence files in this folder (FASTA {', '.join(FASTA_SUFFIXES)}, "
                          f"{', '.join(TABLE_SUFFIXES)}, optionally .gz for FASTA; or a `datasets` save_to_disk folder)")
    return files


def _kind(path: Path) -> Optional[str]:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(FASTA_SUFFIXES):
        return "fasta"
    if path.name.lower().endswith(".gz"):
        return None
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".csv", ".tsv")):
        return "csv"
    if name.endswith(".arrow"):
        return "arrow"
    return None


def read_fasta(path: Path) -> Iterator[tuple[str, str]]:
    """(name, sequence) per record: the header's first word (after '>'), the sequence lines joined. Blank lines
    and ';' comment lines are skipped; text before the first header is an error."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    name, parts, line_number = None, [], 0
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line_number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith(";"):
                continue
            if line.startswith(">"):
                if name is not None:
                    yield name, "".join(parts)
                header = line[1:].split()
                name, parts = (header[0] if header else ""), []
            elif name is None:
                raise ValueError(f"{path}:{line_number}: sequence text before the first '>' header: not FASTA")
            else:
                parts.append(line)
    if name is not None:
        yield name, "".join(parts)


def read_table(path: Path, column: str, name_column: Optional[str]) -> Iterator[tuple[str, str]]:
    """(name, sequence) per row of a parquet, CSV or TSV file (or an Arrow file of a `datasets` folder), read in
    batches; a missing name column gives row numbers, a missing sequence column is an error naming the columns."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    kind = _kind(path)
    if kind == "parquet":
        parquet = pq.ParquetFile(path)
        columns, batches = parquet.schema_arrow.names, None
    elif kind == "csv":
        options = pacsv.ParseOptions(delimiter="\t" if path.name.lower().endswith(".tsv") else ",")
        reader = pacsv.open_csv(path, parse_options=options)
        columns, batches = reader.schema.names, reader
    else:  # arrow: the IPC stream files `datasets.save_to_disk` writes
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        columns, batches = reader.schema.names, reader
    if column not in columns:
        raise ConfigError(f"data.column={column}: {path} has no such column (it has {', '.join(columns)})")
    use_names = name_column is not None and name_column in columns
    if kind == "parquet":
        batches = parquet.iter_batches(columns=[column] + ([name_column] if use_names else []), batch_size=65536)
    row = 0
    for batch in batches:
        sequences = batch.column(column).to_pylist()
        names = batch.column(name_column).to_pylist() if use_names else range(row, row + len(sequences))
        for name, sequence in zip(names, sequences):
            if sequence is not None and not isinstance(sequence, str):
                raise ConfigError(f"data.column={column}: {path} row {row}: expected text, got {type(sequence).__name__}")
            yield str(name), sequence or ""
            row += 1


def datasets_folder_files(path: Path, split: str) -> Optional[list[Path]]:
    """The Arrow files of a `datasets` save_to_disk folder (a Dataset, or a DatasetDict's `split`); None when
    `path` is not one."""
    if (path / "dataset_dict.json").is_file():
        splits = read_json_object(path / "dataset_dict.json").get("splits", [])
        if split not in splits:
            raise ConfigError(f"data.split={split}: {path} is a DatasetDict of splits {splits}")
        path = path / split
    state = path / "state.json"
    if not state.is_file():
        return None
    files = read_json_object(state).get("_data_files", [])
    names = [f.get("filename") for f in files if isinstance(f, dict)] if isinstance(files, list) else []
    if not names or not all(isinstance(n, str) and "/" not in n and "\\" not in n and not n.startswith(".")
                            for n in names):
        raise ConfigError(f"data.path={path}: state.json lists no Arrow files, or names outside the folder")
    return [path / n for n in names]


def records(path: Path, column: str, name_column: Optional[str], split: str) -> Iterator[tuple[str, str]]:
    """(name, sequence) from every file `path` names, in order."""
    files = datasets_folder_files(path, split) if path.is_dir() else None
    for file in files if files is not None else source_files(path):
        if _kind(file) == "fasta":
            yield from read_fasta(file)
        else:
            yield from read_table(file, column, name_column)


def tokenized(named_sequences: Iterable[tuple[str, str]]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, token ids) per sequence; empty sequences are left out."""
    for name, sequence in named_sequences:
        ids = encode_residues(sequence)
        if len(ids):
            yield name, ids


def build_store(named_sequences: Iterable[tuple[str, str]], source: str) -> SequenceStore:
    """Tokenize sequences into a store (in memory); empty sequences are left out."""
    chunks, lengths, names = [], [], []
    for name, ids in tokenized(named_sequences):
        chunks.append(ids)
        lengths.append(len(ids))
        names.append(name)
    if not lengths:
        raise ConfigError(f"data.path={source}: no sequences (or only empty ones)")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SequenceStore(np.concatenate(chunks), offsets, names, source)


def write_store(named_sequences: Iterable[tuple[str, str]], out: Path, source: str) -> dict:
    """Tokenize sequences into files under `out`, streaming (memory: 8 bytes per sequence): residues.bin,
    offsets.npy, names.txt, then index.json (counts and the offsets' hash). They are written into
    <out>.partial and moved to `out` when complete; an existing `out` is refused. Empty sequences are left out."""
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new folder")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    lengths = array.array("q")
    with open(partial / "residues.bin", "wb") as residues, open(partial / "names.txt", "w", encoding="utf-8") as names:
        for name, ids in tokenized(named_sequences):
            residues.write(ids.tobytes())
            names.write(name.replace("\n", " ") + "\n")
            lengths.append(len(ids))
    if not lengths:
        shutil.rmtree(partial)
        raise ValueError(f"{source}: no sequences (or only empty ones)")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    np.save(partial / "offsets.npy", offsets, allow_pickle=False)
    index = {"version": STORE_VERSION, "sequences": len(lengths), "residues": int(offsets[-1]),
             "offsets_sha256": hashlib.sha256(offsets.tobytes()).hexdigest(), "source": source}
    (partial / STORE_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    partial.rename(out)
    return index


def open_store(folder: Path) -> SequenceStore:
    """A store written by write_store, memory-mapped; every count checked against index.json before use."""
    try:
        index = json.loads((folder / STORE_INDEX).read_text())
        sequences, residues = int(index["sequences"]), int(index["residues"])
        if index.get("version") != STORE_VERSION:
            raise ValueError(f"version {index.get('version')!r}, expected {STORE_VERSION}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"data.path={folder}: unreadable {STORE_INDEX} ({e}); write it with "
                          "python -m recipes.esm2.preprocess") from e
    offsets = np.load(folder / "offsets.npy", mmap_mode="r", allow_pickle=False)
    residue_file = folder / "residues.bin"
    problem = None
    if offsets.dtype != np.int64 or offsets.shape != (sequences + 1,):
        problem = f"offsets.npy holds {offsets.dtype} {offsets.shape}, expected int64 ({sequences + 1},)"
    elif not residue_file.is_file() or residue_file.stat().st_size != residues:
        problem = f"residues.bin is not {residues} bytes"
    elif offsets[0] != 0 or offsets[-1] != residues or np.any(np.diff(offsets) <= 0):
        problem = "offsets.npy is not an increasing run of offsets from 0 to the residue count"
    elif hashlib.sha256(np.ascontiguousarray(offsets).tobytes()).hexdigest() != index.get("offsets_sha256"):
        problem = "offsets.npy does not match the hash in index.json"
    if problem:
        raise ConfigError(f"data.path={folder}: {problem}; write the folder again with python -m recipes.esm2.preprocess")
    residues_array = np.memmap(residue_file, dtype=np.uint8, mode="r")
    names_file = folder / "names.txt"
    return SequenceStore(residues_array, offsets, None, str(folder), names_file if names_file.is_file() else None)


def read_store(path: str | Path, column: str = "sequence", name_column: Optional[str] = "id",
               split: str = "train") -> SequenceStore:
    """The sequences `path` names: a preprocessed folder (memory-mapped) or files read now."""
    path = Path(path)
    if path.is_dir() and (path / STORE_INDEX).is_file():
        store = open_store(path)
    else:
        store = build_store(records(path, column, name_column, split), str(path))
    return store
