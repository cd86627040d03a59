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
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Iterable, Iterator, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.config.errors import DataError
from recipes.esm2.partial_output import PartialFolder
from recipes.esm2.sources import DATA_PATH, SourceKeys, read_json_file, records
from recipes.esm2.tokenizer import UNK, encode_residues

log = logging.getLogger("train")

STORE_INDEX = "index.json"
STORE_FILES = ("residues.bin", "offsets.npy", "names.txt", STORE_INDEX)
_LINE_BREAKS = re.compile(r"[\r\n]")
STORE_VERSION = 1
REWRITE = "write the folder again with python -m recipes.esm2.preprocess"
CHECK_CHUNK = 1 << 20  # offsets checked a chunk at a time: no temporary of the whole array
MAX_NAME_BYTES = 64 << 10  # names.txt may average at most this a sequence (a name is a header's first word)


@dataclass
class SequenceStore:
    residues: np.ndarray  # uint8 [total residues]
    offsets: np.ndarray  # int64 [sequences + 1]
    names: Optional[list[str]]  # one per sequence, or None (a preprocessed store reads them on demand)
    source: str  # what gave it, for messages: `data.path=/data/x.fasta`
    names_file: Optional[Path] = None
    folder: Optional["StoreFolder"] = None  # a preprocessed store: pickled as its folder (see StoreFolder)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def lengths_of(self, indices: np.ndarray) -> np.ndarray:
        """The residue counts of sequences `indices` (a temporary of their size only)."""
        return self.offsets[indices + 1] - self.offsets[indices]

    def sequence(self, i: int) -> np.ndarray:
        return self.residues[self.offsets[i] : self.offsets[i + 1]]

    def name(self, i: int) -> str:
        if self.names is None and self.names_file is not None:
            with open(self.names_file, encoding="utf-8", newline="") as f:  # newline="": a lone \r is no line end
                names = f.read().split("\n")
            if names and names[-1] == "":
                names.pop()  # the last line's end
            if len(names) != len(self):
                raise DataError(
                    f"{self.source}: names.txt holds {len(names)} names for {len(self)} sequences; " + REWRITE
                )
            self.names = names
        return self.names[i] if self.names is not None else str(i)

    def __reduce_ex__(self, protocol):
        # A preprocessed store goes to a loader worker (forkserver, spawn) as its folder, not as a copy of every
        # residue; the worker maps the same files.
        if self.folder is not None:
            return self.folder.reopen, ()
        return super().__reduce_ex__(protocol)


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
        parts = [
            f"{n} {what} (first: {self.examples[key]!r})"
            for n, what, key in (
                (self.empty, "empty sequences left out", "empty"),
                (self.unknown_residues, "residues outside the ESM-2 vocabulary read as <unk>", "unknown_residues"),
                (
                    self.nucleotide_like,
                    f"sequences of nucleotide letters only (ACGTUN, {NUCLEOTIDE_CHECK_LENGTH}+ "
                    "long): DNA or RNA read as protein?",
                    "nucleotide_like",
                ),
            )
            if n
        ]
        return "; ".join(parts)


# A protein this long made only of the letters A C G T U N is vanishingly unlikely; nucleic acid is all of them.
NUCLEOTIDE_CHECK_LENGTH = 30
_NUCLEOTIDE = np.zeros(256, dtype=bool)
_NUCLEOTIDE[encode_residues("ACGTUN")] = True


def tokenized(
    named_sequences: Iterable[tuple[str, str]], counts: Optional[ReadCounts] = None
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
        raise DataError(f"{source}: no sequences (or only empty ones)")
    if counts.summary():
        log.warning("%s: %s", source, counts.summary())
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SequenceStore(np.concatenate(chunks), offsets, names, source)


def write_store(
    named_sequences: Iterable[tuple[str, str]],
    out: Path,
    source: str,
    named: Optional[str] = None,
    option: str = "--out",
    say: Callable[[str], None] = log.warning,
) -> dict:
    """Tokenize sequences into files under `out`, streaming (memory: 8 bytes per sequence): residues.bin,
    offsets.npy, names.txt (one per line: a line break inside a name becomes a space), then index.json (counts,
    the offsets' hash, what tokenizing left out). They are written into this process's `<out>.partial-<pid>` and
    renamed to `out` when complete; a failure removes them, an existing `out` or another run writing it is refused
    (recipes/esm2/partial_output.py). Empty sequences are left out. `named` (default: `source`) and `option` name
    the input and the output in messages."""
    with PartialFolder(out, STORE_FILES, option, say) as folder:
        lengths, counts = array.array("q"), ReadCounts()
        with (
            open(folder.path / "residues.bin", "wb") as residues,
            open(folder.path / "names.txt", "w", encoding="utf-8", newline="") as names,
        ):
            for name, ids in tokenized(named_sequences, counts):
                residues.write(ids.tobytes())
                names.write(_LINE_BREAKS.sub(" ", name) + "\n")
                lengths.append(len(ids))
        if not lengths:
            raise DataError(f"{named or source}: no sequences (or only empty ones)")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        np.save(folder.path / "offsets.npy", offsets, allow_pickle=False)
        index = {
            "version": STORE_VERSION,
            "sequences": len(lengths),
            "residues": int(offsets[-1]),
            "offsets_sha256": hashlib.sha256(offsets).hexdigest(),
            "source": source,
            "empty_sequences_left_out": counts.empty,
            "unknown_residues": counts.unknown_residues,
            "nucleotide_like_sequences": counts.nucleotide_like,
            "notes": counts.summary(),
        }
        (folder.path / STORE_INDEX).write_text(json.dumps(index, indent=1) + "\n")
        folder.publish()
    return index


class StoreIndex(BaseModel):
    """index.json: the counts and the offsets' hash the other files are checked against."""

    model_config = ConfigDict(strict=True)
    version: Literal[STORE_VERSION]
    sequences: Annotated[int, Field(ge=1, le=2**40)]
    residues: Annotated[int, Field(ge=1, le=2**62)]
    offsets_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _fingerprint(folder: Path) -> tuple:
    """The store's files as they are now, (name, device, inode, size, modification time) each: a folder written
    again or replaced gives another."""
    found = []
    for name in STORE_FILES:
        try:
            status = os.stat(folder / name)
        except FileNotFoundError:
            continue
        found.append((name, status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns))
    return tuple(found)


@dataclass(frozen=True)
class StoreFolder:
    """A preprocessed store's folder as a run opened it: the files then (`fingerprint`) and the setting that
    named it. What a store pickles as; a worker that unpickles it maps the same files again, and refuses a folder
    removed or written again since (it would read other sequences than the main process planned packs of)."""

    path: Path
    keys: SourceKeys
    fingerprint: tuple

    def reopen(self) -> SequenceStore | UnavailableStore:
        store = None
        if _fingerprint(self.path) == self.fingerprint:
            try:
                store = _map_store(self.path, self.keys, self.fingerprint)
            except (OSError, ValueError):  # removed or replaced meanwhile: told below
                store = None
        if store is None or _fingerprint(self.path) != self.fingerprint:  # what was mapped is what was checked
            what = "written again (its files changed)" if self.path.exists() else "removed"
            return UnavailableStore(
                f"{self.keys.of('path', self.path)}: the store was {what} after this run opened it; start the run again"
            )
        return store


@dataclass(frozen=True)
class UnavailableStore:
    """What an unpickled store is when its folder was removed or written again: each read raises the DataError.
    Raised while a loader worker unpickles its dataset, it would end the worker before its loop (the main process
    sees only "worker exited unexpectedly"); raised from a read, it reaches the main process as one line."""

    message: str

    def _refuse(self, *args):
        raise DataError(self.message)

    __len__ = lengths = lengths_of = sequence = name = _refuse


def _map_store(folder: Path, keys: SourceKeys, fingerprint: tuple) -> SequenceStore:
    offsets = np.load(folder / "offsets.npy", mmap_mode="r", allow_pickle=False)
    residues = np.memmap(folder / "residues.bin", dtype=np.uint8, mode="r")
    names_file = folder / "names.txt"
    return SequenceStore(
        residues,
        offsets,
        None,
        keys.of("path", folder),
        names_file if names_file.is_file() else None,
        StoreFolder(folder, keys, fingerprint),
    )


def open_store(folder: Path, keys: SourceKeys = DATA_PATH) -> SequenceStore:
    """A store written by write_store, memory-mapped; its files checked against each other before any use
    (index.json's counts, offsets.npy's type, shape, order and hash, residues.bin's size). A damaged store is a
    DataError naming the folder (after the setting that gave it) and the file."""
    named = keys.of("path", folder)
    fingerprint = _fingerprint(folder)
    index = read_json_file(folder / STORE_INDEX, StoreIndex, named, REWRITE)
    problem = _files_problem(folder, index)
    if problem is None:
        try:
            store = _map_store(folder, keys, fingerprint)
            problem = _offsets_problem(store.offsets, index)
        except OSError as e:  # unreadable (permissions), or replaced while being opened
            problem = f"cannot read its files ({e})"
    if problem:
        raise DataError(f"{named}: {problem}; {REWRITE}")
    return store


def _files_problem(folder: Path, index: StoreIndex) -> Optional[str]:
    """What is wrong with offsets.npy and residues.bin as files: absent, not an int64 array of index.json's
    sequences + 1 offsets, not index.json's residues bytes (None: nothing)."""
    offsets_file, residue_file = folder / "offsets.npy", folder / "residues.bin"
    for file in (offsets_file, residue_file):
        if not file.is_file():  # also refuses a FIFO, which would block the reader
            return f"{file.name} is missing or not a file"
    if residue_file.stat().st_size != index.residues:
        return f"residues.bin is {residue_file.stat().st_size} bytes, not index.json's residues={index.residues}"
    names_file = folder / "names.txt"
    if names_file.exists() or names_file.is_symlink():  # read whole when a name is asked for: a bounded regular file
        if not names_file.is_file():
            return "names.txt is not a regular file"
        if names_file.stat().st_size > MAX_NAME_BYTES * (index.sequences + 1):
            return f"names.txt is {names_file.stat().st_size} bytes, far more than names of {index.sequences} sequences"
    try:
        offsets = np.load(offsets_file, mmap_mode="r", allow_pickle=False)  # never a pickle
    except (OSError, ValueError, EOFError) as e:
        return f"offsets.npy is not a NumPy array of offsets ({e})"
    if offsets.dtype != np.int64 or offsets.shape != (index.sequences + 1,):
        return (
            f"offsets.npy holds {offsets.dtype} {offsets.shape}, expected int64 ({index.sequences + 1},) "
            f"for index.json's sequences={index.sequences}"
        )
    return None


def _offsets_problem(offsets: np.ndarray, index: StoreIndex) -> Optional[str]:
    """Offsets that do not increase from 0 to the residue count, or whose hash is not index.json's."""
    if offsets[0] != 0 or offsets[-1] != index.residues:
        return (
            f"offsets.npy runs from {offsets[0]} to {offsets[-1]}, not from 0 to index.json's residues={index.residues}"
        )
    for start in range(0, len(offsets) - 1, CHECK_CHUNK):
        chunk = offsets[start : start + CHECK_CHUNK + 1]
        if np.any(chunk[1:] <= chunk[:-1]):
            first = start + int(np.argmax(chunk[1:] <= chunk[:-1]))
            return f"offsets.npy does not increase at sequence {first} (an empty or negative length)"
    if hashlib.sha256(offsets).hexdigest() != index.offsets_sha256:
        return "offsets.npy does not match the hash in index.json"
    return None


def read_store(
    path: str | Path,
    column: str = "sequence",
    name_column: Optional[str] = "id",
    split: str = "train",
    keys: SourceKeys = DATA_PATH,
) -> SequenceStore:
    """The sequences `path` names: a preprocessed folder (memory-mapped) or files read now. Messages name `path`
    after the setting that gave it (`keys`: data.path, data.val_path, predict.folder, ...)."""
    path = Path(path)
    if path.is_dir() and (path / STORE_INDEX).exists():
        return open_store(path, keys)
    return build_store(records(path, column, name_column, split, keys), keys.of("path", path))
