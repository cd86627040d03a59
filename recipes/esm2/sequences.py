"""Protein sequences from the files people keep them in, as one array of residue tokens and their offsets.

Sources (`read_store`): what `recipes/esm2/sources.py` reads (FASTA, parquet, CSV/TSV, Arrow and `datasets`
folders, folders and patterns of them), tokenized now and held in memory; or a folder written by
`python -m recipes.esm2.preprocess` (`write_store`): the same arrays on disk, memory-mapped, so that a run over
100M+ sequences reads and tokenizes nothing again and every process shares the pages.

A store is two arrays, `residues` (uint8 token ids, every sequence's residues one after another, no <cls>/<eos>)
and `offsets` (int64, sequence i is residues[offsets[i]:offsets[i+1]]), and the sequences' names. That is what
keeps resume exact: sequence i is the same tokens in every process and every run.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from core.config.errors import ConfigError
from recipes.esm2.sources import records
from recipes.esm2.tokenizer import UNK, encode_residues

log = logging.getLogger("train")

STORE_INDEX = "index.json"
_LINE_BREAKS = re.compile(r"[\r\n]")
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
            with open(self.names_file, encoding="utf-8", newline="") as f:  # newline="": a lone \r is no line end
                names = f.read().split("\n")
            if names and names[-1] == "":
                names.pop()  # the last line's end
            if len(names) != len(self):
                raise ConfigError(f"data.path={self.source}: names.txt holds {len(names)} names for {len(self)} "
                                  "sequences; write the folder again with python -m recipes.esm2.preprocess")
            self.names = names
        return self.names[i] if self.names is not None else str(i)


@dataclass
class ReadCounts:
    """What tokenizing left out or could not read, for the user to see: empty sequences (left out), residues that
    became <unk>, and sequences of nucleotide letters only (DNA or RNA read as protein?)."""
    sequences: int = 0
    empty: int = 0
    unknown_residues: int = 0
    nucleotide_like: int = 0
    examples: dict = field(default_factory=dict)  # the first sequence's name of each kind

    def add(self, name: str, ids: np.ndarray) -> None:
        if not len(ids):
            self.empty += 1
            self.examples.setdefault("empty", name)
            return
        self.sequences += 1
        unknown = int(np.count_nonzero(ids == UNK))
        if unknown:
            self.unknown_residues += unknown
            self.examples.setdefault("unknown_residues", name)
        if len(ids) >= NUCLEOTIDE_CHECK_LENGTH and _NUCLEOTIDE[ids].all():
            self.nucleotide_like += 1
            self.examples.setdefault("nucleotide_like", name)

    def summary(self) -> str:
        """One line, empty when there is nothing to say."""
        parts = [f"{n} {what} (first: {self.examples[key]!r})" for n, what, key in (
            (self.empty, "empty sequences left out", "empty"),
            (self.unknown_residues, "residues outside the ESM-2 vocabulary read as <unk>", "unknown_residues"),
            (self.nucleotide_like, f"sequences of nucleotide letters only (ACGTUN, {NUCLEOTIDE_CHECK_LENGTH}+ "
                                   "long): DNA or RNA read as protein?", "nucleotide_like")) if n]
        return "; ".join(parts)


# A protein this long made only of the letters A C G T U N is vanishingly unlikely; nucleic acid is all of them.
NUCLEOTIDE_CHECK_LENGTH = 30
_NUCLEOTIDE = np.zeros(256, dtype=bool)
_NUCLEOTIDE[encode_residues("ACGTUN")] = True


def tokenized(named_sequences: Iterable[tuple[str, str]], counts: Optional[ReadCounts] = None
              ) -> Iterator[tuple[str, np.ndarray]]:
    """(name, token ids) per sequence; empty sequences are left out (and counted in `counts`)."""
    for name, sequence in named_sequences:
        ids = encode_residues(sequence)
        if counts is not None:
            counts.add(name, ids)
        if len(ids):
            yield name, ids


def build_store(named_sequences: Iterable[tuple[str, str]], source: str) -> SequenceStore:
    """Tokenize sequences into a store (in memory: about twice the residues, and the names); empty sequences are
    left out. What tokenizing left out or could not read is logged."""
    chunks, lengths, names, counts = [], [], [], ReadCounts()
    for name, ids in tokenized(named_sequences, counts):
        chunks.append(ids)
        lengths.append(len(ids))
        names.append(name)
    if not lengths:
        raise ConfigError(f"data.path={source}: no sequences (or only empty ones)")
    if counts.summary():
        log.warning("%s: %s", source, counts.summary())
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SequenceStore(np.concatenate(chunks), offsets, names, source)


def write_store(named_sequences: Iterable[tuple[str, str]], out: Path, source: str) -> dict:
    """Tokenize sequences into files under `out`, streaming (memory: 8 bytes per sequence): residues.bin,
    offsets.npy, names.txt (one per line: a line break inside a name becomes a space), then index.json (counts,
    the offsets' hash, what tokenizing left out). They are written into <out>.partial and moved to `out` when
    complete (a failure removes them); an existing `out` is refused. Empty sequences are left out."""
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new folder")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        lengths, counts = array.array("q"), ReadCounts()
        with open(partial / "residues.bin", "wb") as residues, \
                open(partial / "names.txt", "w", encoding="utf-8", newline="") as names:
            for name, ids in tokenized(named_sequences, counts):
                residues.write(ids.tobytes())
                names.write(_LINE_BREAKS.sub(" ", name) + "\n")
                lengths.append(len(ids))
        if not lengths:
            raise ConfigError(f"{source}: no sequences (or only empty ones)")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        np.save(partial / "offsets.npy", offsets, allow_pickle=False)
        index = {"version": STORE_VERSION, "sequences": len(lengths), "residues": int(offsets[-1]),
                 "offsets_sha256": hashlib.sha256(offsets.tobytes()).hexdigest(), "source": source,
                 "empty_sequences_left_out": counts.empty, "unknown_residues": counts.unknown_residues,
                 "nucleotide_like_sequences": counts.nucleotide_like, "notes": counts.summary()}
        (partial / STORE_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
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
