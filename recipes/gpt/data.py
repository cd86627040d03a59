"""GPT data through Megatron-Core's datasets: GPTDataset over indexed .bin/.idx files (document shuffling,
sample index, train/validation/test split by Megatron-Core) or MockGPTDataset.

Samples are dicts of tensors: "tokens" [seq], "labels" [seq] (the next tokens), "loss_mask" [seq] (0 on
padding, and after an end-of-document with data.eod_mask_loss), "position_ids" [seq], and "idx"; with data.packing
also "cu_seqlens" [data.max_documents_per_sample + 2] (int32): the sample's documents, each ending after an
end-of-document token, so attention stays within each (recipes/gpt/packing.py).
Megatron-Core builds the sample indices once and caches them in data.cache_dir; `dataset[i]` is the
same sample on every call and rank (a resumed run continues on the same tokens).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import signal
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from core.config.errors import ConfigError, DataError
from core.config.file_shape import read_small_file
from core.data.partial_outputs import Stopped
from recipes.gpt.config import GPTDataConfig
from recipes.gpt.megatron_core import import_quietly
from recipes.gpt.options import DATA_CONFIG
from recipes.gpt.packing import eod_document_count, eod_document_lengths, row_offsets
from recipes.gpt.tokenizer import build_tokenizer

log = logging.getLogger(__name__)


def megatron_datasets():
    """Megatron-Core's dataset modules (imported quietly: recipes/gpt/megatron_core.py), and ours over them
    (recipes/gpt/token_ids.py)."""
    import_quietly()
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from recipes.gpt import token_ids

    return gpt_dataset, BlendedMegatronDatasetBuilder, token_ids


class MockTokenizer:
    """What MockGPTDataset needs: a vocabulary size, an end-of-document id (the last id) and a pad id.

    The mock documents hold every id below the vocabulary size, so the pad id is one past it: Megatron-Core
    masks the loss on pad labels in place on the loss mask it caches from the first sample it reads, and an id
    the data holds made every later mask depend on which sample came first (a resumed run saw other masks)."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod, self.pad = vocab_size, vocab_size - 1, vocab_size
        self.unique_identifiers = {"tokenizer": "mock", "vocab_size": vocab_size}


class DocumentOffsets:
    """data.packing for Megatron samples: a sample's "cu_seqlens", its documents split after each end-of-document
    token. A sample of more than `max_documents` documents keeps the first ones apart and lets the last ones share
    the final span; `merged` counts such samples in this process, logged at the 1st, 2nd, 4th, 8th, ... one."""

    def __init__(self, eod: int, max_documents: int):
        self.eod, self.max_documents, self.merged = eod, max_documents, 0

    def __call__(self, tokens: torch.Tensor, idx: int) -> torch.Tensor:
        ids = tokens.numpy()
        lengths = eod_document_lengths(ids, self.eod, self.max_documents)
        if len(lengths) == self.max_documents:
            documents = eod_document_count(ids, self.eod)
            if documents > self.max_documents:
                self.merged += 1
                if self.merged & (self.merged - 1) == 0:
                    log.warning(
                        "data.packing: sample %d holds %d documents, more than data.max_documents_per_sample=%d: "
                        "its last %d share one span (attention crosses them); %d such samples in this process",
                        idx,
                        documents,
                        self.max_documents,
                        documents - self.max_documents + 1,
                        self.merged,
                    )
        offsets = row_offsets(lengths, len(ids), self.max_documents + 1)
        return torch.from_numpy(offsets)


class Samples(Dataset):
    """A Megatron-Core GPT dataset with the sample's index added, indexed by int or EpochIndex; with
    `documents` (data.packing) each sample's document offsets too."""

    def __init__(self, dataset, documents: Optional[DocumentOffsets] = None):
        self.dataset, self.documents = dataset, documents

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index) -> dict:
        from core.data.datasets import epoch_index

        idx = epoch_index(index).idx
        sample = {k: v for k, v in self.dataset[idx].items() if k in ("tokens", "labels", "loss_mask", "position_ids")}
        sample["idx"] = idx
        if self.documents is not None:
            sample["cu_seqlens"] = self.documents(sample["tokens"], idx)
        return sample


def tokenize_text_once(data: GPTDataConfig, tokenizer) -> str:
    """The indexed-dataset prefix of data.text_files, tokenized on first use into data.cache_dir.

    The prefix is named by a hash of the files (path, size, modification time), the tokenizer and the
    document rule, so a change re-tokenizes. One process tokenizes under a file lock; the others wait."""
    from recipes.gpt.preprocess import preprocess

    if not data.text_files:
        raise ConfigError("data.format=text needs data.text_files")
    files = [Path(f) for f in data.text_files]
    for f in files:
        if not f.is_file():
            raise DataError(
                f"data.text_files: {f} does not exist" + (" (a folder: give its files)" if f.is_dir() else "")
            )
    key = json.dumps(
        [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        + [dict(tokenizer.unique_identifiers), data.text_document, data.text_key]
    )
    prefix = Path(data.cache_dir) / "tokenized" / f"{files[0].stem}-{hashlib.md5(key.encode()).hexdigest()[:12]}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"{prefix}.json").exists():  # written last by preprocess: the files are whole
            log.info(
                "tokenizing %s with the %s tokenizer into %s.bin/.idx",
                ", ".join(map(str, files)),
                data.tokenizer,
                prefix,
            )
            try:
                preprocess(
                    files,
                    prefix,
                    data.tokenizer,
                    data.text_key,
                    data.text_document,
                    data.eod_token,
                    replace=True,
                    options=DATA_CONFIG,
                )
            except Stopped as e:  # its partial files removed: the signal does now what it would have done
                signal.raise_signal(e.signum)
                raise SystemExit(128 + e.signum) from None
    return str(prefix)


def layout_problem(lengths: np.ndarray, pointers: np.ndarray, itemsize: int, chunk: int = 1 << 22) -> Optional[str]:
    """What is wrong with an .idx's documents, or None: each must hold a token and start where the one before
    ends. Otherwise Megatron-Core reads documents twice or past the .bin, or (no tokens at all) loops forever
    looking for an epoch's worth. Checked in chunks, so a huge index needs no second copy in memory."""
    if not len(lengths):
        return "it holds no documents (no tokens)"
    start = 0  # in bytes: where the next document must begin
    for first in range(0, len(lengths), chunk):
        part = lengths[first : first + chunk].astype(np.int64)
        short = np.flatnonzero(part < 1)
        if short.size:
            i = first + int(short[0])
            return f"document {i} holds {int(lengths[i])} tokens"
        ends = start + np.cumsum(part) * itemsize
        starts = np.concatenate(([start], ends[:-1]))
        wrong = np.flatnonzero(pointers[first : first + chunk] != starts)
        if wrong.size:
            i = first + int(wrong[0])
            at, should = int(pointers[i]), int(starts[wrong[0]])
            return f"document {i} starts at byte {at}, not at {should} where the one before ends"
        start = int(ends[-1])
    return None


def check_prefix(prefix: str, tokenizer) -> None:
    """Refuse a <prefix>.bin that is not the size its .idx describes (a copy cut short, a file from another pair),
    and, where our preprocess's <prefix>.json says how the pair was made, an .idx whose token type or count differs
    from it or a data.tokenizer other than the one it was made with: each would be read as other tokens, or fail
    mid-run without naming the file. Files from elsewhere (no .json) get the checks of the .idx alone: an
    integer token type, the size, and documents of at least one token each, laid end to end."""
    import_quietly()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

    try:
        index = IndexedDataset(prefix).index
        lengths, pointers = index.sequence_lengths, index.sequence_pointers
        expected = int(pointers[-1]) + int(lengths[-1]) * index.dtype_size if len(lengths) else 0
    except AssertionError as e:  # Megatron-Core's checks of the counts carry no message
        reason = str(e) or "its document indices disagree with its number of sequences"
        raise DataError(f"data.prefixes: {prefix}.idx: unreadable ({reason})") from None
    except Exception as e:  # noqa: BLE001 (numpy and struct errors)
        raise DataError(f"data.prefixes: {prefix}.idx: unreadable ({type(e).__name__}: {e})") from None
    if not np.issubdtype(index.dtype, np.integer):
        raise DataError(f"data.prefixes: {prefix}.idx: token type {index.dtype.__name__}, not an integer type")
    size = Path(f"{prefix}.bin").stat().st_size
    if size != expected:
        raise DataError(
            f"data.prefixes: {prefix}.bin holds {size} bytes, its .idx describes {expected}: a copy cut "
            "short, or not the .idx's own .bin"
        )
    problem = layout_problem(lengths, pointers, index.dtype_size)
    if problem:
        raise DataError(f"data.prefixes: {prefix}.idx: {problem}: damaged, or not written by a Megatron writer")
    record = Path(f"{prefix}.json")
    try:
        made = json.loads(read_small_file(record, 1 << 24, follow_symlinks=True)) if record.is_file() else None
    except (OSError, ValueError, RecursionError):  # not ours, or damaged: the size check is all there is
        made = None
    if not isinstance(made, dict) or not isinstance(made.get("vocab_size"), int):
        return
    if isinstance(made.get("tokens"), int):
        dtype = DType.optimal_dtype(made["vocab_size"])
        if index.dtype != dtype or int(lengths.sum()) != made["tokens"]:
            raise DataError(
                f"data.prefixes: {prefix}.idx holds {int(lengths.sum())} tokens of {index.dtype.__name__}, "
                f"its .json says {made['tokens']} of {dtype.__name__}: the .idx is damaged or another's"
            )
    ours = {
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "tokenizer_sha256": getattr(tokenizer, "sha256", None),
    }
    differ = [
        f"{k} {made[k]!r} there, {v!r} now" for k, v in ours.items() if made.get(k) is not None and made.get(k) != v
    ]
    if differ:
        raise ConfigError(
            f"data.tokenizer={tokenizer.name}: {prefix}.bin/.idx were tokenized with "
            f"{made.get('tokenizer')!r} ({'; '.join(differ)}); give that tokenizer, or preprocess again"
        )


def index_cache_dir(cache_dir: str, prefixes: list[str], tokenizer) -> str:
    """Megatron-Core's sample-index cache, in a folder named by what the index depends on beyond its own key
    (which names the prefixes by path only): the files' sizes and times, and the tokenizer. A prefix made
    again, or a tokenizer replaced in its folder, gets a fresh index instead of a stale one."""
    files = [
        [str(Path(f"{p}{s}").resolve()), Path(f"{p}{s}").stat().st_size, Path(f"{p}{s}").stat().st_mtime_ns]
        for p in prefixes
        for s in (".bin", ".idx")
    ]
    key = json.dumps([files, dict(tokenizer.unique_identifiers)])
    return str(Path(cache_dir) / "megatron_index" / hashlib.md5(key.encode()).hexdigest()[:16])


def padded_vocab_size(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def build_gpt_datasets(
    data: GPTDataConfig, seq_length: int, seed: int, num_train_samples: int, vocab_size: Optional[int]
) -> tuple[Dataset, Optional[Dataset], Optional[Dataset]]:
    """(train, validation, test) for `num_train_samples` training samples of `seq_length` tokens."""
    gpt_dataset, builder, token_ids = megatron_datasets()
    if data.format == "mock":
        if vocab_size is None:
            raise ConfigError("data.format=mock needs model.vocab_size")
        tokenizer, blend, split, cls = MockTokenizer(vocab_size), None, None, gpt_dataset.MockGPTDataset
    else:
        tokenizer = build_tokenizer(data.tokenizer, data.eod_token)
        prefixes = [tokenize_text_once(data, tokenizer)] if data.format == "text" else list(data.prefixes)
        if not prefixes:
            raise ConfigError("data.format=indexed needs data.prefixes (<prefix>.bin/.idx)")
        for p in prefixes:
            missing = [f"{p}{s}" for s in (".bin", ".idx") if not Path(f"{p}{s}").is_file()]
            if missing:
                raise DataError(
                    f"data.prefixes: {' and '.join(missing)} not found (a prefix names <prefix>.bin and "
                    "<prefix>.idx: python -m recipes.gpt.preprocess writes them)"
                )
            check_prefix(p, tokenizer)
        weights = list(data.weights) if data.weights is not None else None
        blend, split, cls = (prefixes, weights), data.split, token_ids.CheckedGPTDataset
    config = token_ids.CheckedGPTDatasetConfig(
        source="data.text_files (tokenized in data.cache_dir)" if data.format == "text" else "data.prefixes",
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # the attention is causal by construction
        path_to_cache=(
            str(Path(data.cache_dir) / "megatron_index")
            if data.format == "mock"
            else index_cache_dir(data.cache_dir, prefixes, tokenizer)
        ),
        mmap_bin_files=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pad.*")
        train, val, test = builder(cls, [num_train_samples, data.val_num_samples, None], lambda: True, config).build()
    documents = DocumentOffsets(tokenizer.eod, data.max_documents_per_sample) if data.packing else None
    return tuple(Samples(d, documents) if d is not None and len(d) else None for d in (train, val, test))


class DocumentWindows(Dataset):
    """The documents of one split cut into windows, for per-document scores (predict.py).

    A document is scored as training reads it: each of its tokens, its end-of-document token included, is
    predicted from the tokens before it, the first one after an end-of-document token. Documents longer
    than `seq_length` predicted tokens span several windows, each predicted from its own tokens only (no
    overlap). Items are windows, {"tokens", "labels", "loss_mask": [seq_length], "idx", "document"}; the
    `documents` list gives each document's (source prefix, sequence number in it).
    """

    def __init__(self, parts: list[tuple[str, Any, np.ndarray]], seq_length: int, eod: int, eod_mask_loss: bool):
        self.parts, self.seq_length, self.eod, self.eod_mask_loss = parts, seq_length, eod, eod_mask_loss
        self.documents: list[tuple[int, int]] = []  # (part, sequence id)
        self.windows: list[tuple[int, int]] = []  # (document, first predicted position)
        for p, (_, indexed, ids) in enumerate(parts):
            for seq_id, length in zip(ids.tolist(), indexed.sequence_lengths[ids].tolist()):
                self.windows += [(len(self.documents), start) for start in range(0, length, seq_length)]
                self.documents.append((p, seq_id))

    def __len__(self) -> int:
        return len(self.windows)

    def document_tokens(self, document: int) -> np.ndarray:
        part, seq_id = self.documents[document]
        return self.parts[part][1].get(seq_id)

    def __getitem__(self, index) -> dict:
        from core.data.datasets import epoch_index

        idx = epoch_index(index).idx
        document, start = self.windows[idx]
        sequence = self.document_tokens(document).astype(np.int64)
        inputs = np.concatenate(([self.eod], sequence[:-1]))  # token i is predicted after tokens < i
        n = min(self.seq_length, len(sequence) - start)
        tokens = torch.full((self.seq_length,), self.eod, dtype=torch.long)
        labels = torch.zeros(self.seq_length, dtype=torch.long)
        tokens[:n] = torch.from_numpy(inputs[start : start + n])
        labels[:n] = torch.from_numpy(sequence[start : start + n])
        loss_mask = torch.zeros(self.seq_length)
        loss_mask[:n] = 1.0
        if self.eod_mask_loss and start == 0:
            loss_mask[0] = 0.0  # training does not score the token after an end-of-document either
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "idx": idx, "document": document}


def document_windows(
    split_dataset: Optional[Samples], split: str, seq_length: int, eod: int, eod_mask_loss: bool
) -> DocumentWindows:
    """The documents Megatron-Core assigned to `split` (data.split), from every blended source."""
    if split_dataset is None:
        raise ConfigError(f"predict.split={split}: the split has no documents (data.split shares them out)")
    dataset = split_dataset.dataset
    sources = getattr(dataset, "datasets", [dataset])  # a blend, or one GPTDataset
    if not all(hasattr(s, "indices") and hasattr(s, "dataset") for s in sources):
        raise ConfigError("per-document scores need documents: data.format=text or indexed, not mock")
    return DocumentWindows(
        [(s.dataset_path, s.dataset, np.sort(s.indices)) for s in sources], seq_length, eod, eod_mask_loss
    )
