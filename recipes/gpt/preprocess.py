"""Tokenize text into Megatron's indexed dataset format (<prefix>.bin + <prefix>.idx) for GPTDataset.

    python -m recipes.gpt.preprocess --input books/*.txt docs.jsonl table.parquet --output-prefix data/corpus \
        [--tokenizer byte | /path/to/hf_tokenizer] [--text-key text] [--text-document paragraph|line|file]

Inputs by suffix: .txt (documents are paragraphs, separated by blank lines; or lines; or whole files),
.jsonl (one JSON object per line, the document in --text-key), .parquet (the --text-key column; needs
pyarrow). Every document is tokenized and followed by the end-of-document token. Also writes
<prefix>.json with the tokenizer, counts and sources. The files appear complete or not at all: a failure,
SIGTERM or SIGHUP removes what was written (exit code 2, 143, 129), and what a killed run left is removed by
the next run for the prefix (recipes/gpt/partial_outputs.py). A bad input is one line, `error: ...`.

    python -m recipes.gpt.preprocess --decode data/corpus --document 3     # print document 3 back as text
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from core.config.errors import ConfigError, DataError
from core.data.json_lines import MAX_LINE_BYTES
from core.data.parquet_text import TextRefused, text_batches
from core.data.partial_outputs import Stopped, stop_signal
from core.data.text_lines import bounded_lines
from core.generation.prompts import lone_surrogate
from recipes.gpt.megatron_core import import_quietly
from recipes.gpt.options import COMMAND_LINE, Options, given
from recipes.gpt.partial_outputs import partial_outputs, remove_leftovers, temporary_prefix
from recipes.gpt.text_documents import TEXT_DOCUMENTS, read_text_documents
from recipes.gpt.tokenizer import build_tokenizer

SUFFIXES = (".txt", ".jsonl", ".parquet")
BATCH_CHARACTERS = 1 << 20  # text tokenized at a time (the tokenizer's batch encoding), at most
BATCH_DOCUMENTS = 4096

MAX_DOCUMENT_BYTES = 16 << 20  # one parquet row's text: a long book is a few MB


def read_documents(
    path: Path, text_key: str = "text", text_document: str = "paragraph", options: Options = COMMAND_LINE
) -> Iterator[str]:
    """The documents of one input file, by its suffix; `options` name what gave the file and key in errors."""
    suffix, named = path.suffix.lower(), given(options.input, path)
    try:
        if suffix == ".txt":
            yield from read_text_documents(path, text_document, named)
        elif suffix == ".jsonl":
            yield from read_jsonl(path, text_key, named, given(options.text_key, text_key))
        elif suffix == ".parquet":
            yield from read_parquet(path, text_key, named, given(options.text_key, text_key))
        else:
            raise DataError(f"{named}: unknown input type {suffix!r} (expected .txt, .jsonl or .parquet)")
    except OSError as e:
        raise DataError(f"{named}: unreadable ({e.strerror or e})") from None


def read_jsonl(path: Path, text_key: str, named: str, key_named: str) -> Iterator[str]:
    """The texts of a JSON Lines file; a blank text is left out, as a .txt's blank documents are (it would be an
    end-of-document token alone); a byte-order mark on the first line is allowed."""

    def too_long(number: int) -> DataError:
        return DataError(f"{named}:{number}: a line longer than {MAX_LINE_BYTES >> 20} MiB (no line end?)")

    with open(path, "rb") as f:
        for number, raw_line in enumerate(bounded_lines(f, MAX_LINE_BYTES, too_long), 1):
            try:
                line = raw_line.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{named}:{number}: not UTF-8 text (byte {e.start} of the line: {e.reason}); is it a binary file?"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, or an integer int() refuses
                raise DataError(f"{named}:{number}: not JSON ({type(e).__name__}: {str(e)[:100]})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise DataError(f"{named}:{number}: no text under the key {text_key!r} ({key_named})")
            text = record[text_key]
            if lone_surrogate(text):
                raise DataError(
                    f"{named}:{number}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff): not "
                    "text any tokenizer encodes"
                )
            if text.strip():
                yield text


def read_parquet(path: Path, text_key: str, named: str, key_named: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 (pyarrow's errors are of its own types)
        raise DataError(f"{named}: unreadable as parquet ({type(e).__name__}: {e})") from None
    if text_key not in table.schema_arrow.names:
        raise DataError(
            f"{named}: no column {text_key!r} ({key_named}; columns: {', '.join(table.schema_arrow.names)})"
        )
    row = 0
    try:  # bounded: a document stored once and compressed may expand far (core/data/parquet_text.py)
        for batch in text_batches(path, [text_key], MAX_DOCUMENT_BYTES):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):  # a null or a number: as a .jsonl line without text, refused
                    raise DataError(f"{named}: row {row}: no text in the column {text_key!r} ({text!r:.40})")
                if text.strip():  # a blank text left out, as in the other formats
                    yield text
                row += 1
    except TextRefused as e:
        raise DataError(f"{named}: {e}") from None


def check_inputs(inputs: list[Path], output_prefix: Path, replace: bool, options: Options) -> None:
    """Refuse, before anything is tokenized: a missing input or one of unknown type, a file given twice,
    existing outputs (unless `replace`)."""
    for path in inputs:
        named = given(options.input, path)
        if not path.is_file():
            raise DataError(f"{named}: no such input file" + (" (a folder: give its files)" if path.is_dir() else ""))
        if path.suffix.lower() not in SUFFIXES:
            raise DataError(f"{named}: unknown input type {path.suffix!r} (expected .txt, .jsonl or .parquet)")
    times = Counter(p.resolve() for p in inputs)
    repeated = sorted({str(p) for p in inputs if times[p.resolve()] > 1})
    if repeated:
        raise DataError(
            f"{options.input}: {', '.join(repeated)}: given twice (its documents would be trained on twice)"
        )
    existing = [f"{output_prefix}{s}" for s in (".bin", ".idx", ".json") if Path(f"{output_prefix}{s}").exists()]
    if existing and not replace:
        raise DataError(f"{', '.join(existing)} exist; choose another {options.output_prefix} (or remove them)")


def batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """Documents in lists of at most BATCH_DOCUMENTS and, but for a longer document, BATCH_CHARACTERS."""
    documents = iter(documents)
    while True:
        batch, size = [], 0
        for text in islice(documents, BATCH_DOCUMENTS):
            batch.append(text)
            size += len(text)
            if size >= BATCH_CHARACTERS:
                break
        if not batch:
            return
        yield batch


def write_documents(builder, tokenizer, documents: Iterable[str]) -> tuple[int, int]:
    """Tokenize `documents` a batch at a time into `builder`, each followed by the end of document; return the
    number of documents and of tokens."""
    count = tokens = 0
    for batch in batches(documents):
        for ids in tokenizer.encode_batch(batch):
            document = np.empty(len(ids) + 1, dtype=builder.dtype)
            document[:-1], document[-1] = ids, tokenizer.eod
            builder.add_document(document, [len(document)])
            count, tokens = count + 1, tokens + len(document)
    return count, tokens


def preprocess(
    inputs: list[Path],
    output_prefix: Path,
    tokenizer_spec: str = "byte",
    text_key: str = "text",
    text_document: str = "paragraph",
    eod_token: Optional[str] = None,
    replace: bool = False,
    options: Options = COMMAND_LINE,
) -> dict:
    """Write <output_prefix>.bin/.idx/.json; return the summary that goes into the .json. Existing outputs are
    refused unless `replace` (the tokenize-on-first-use cache, which owns its prefix). `options` name the command
    line's options or the config's settings in errors. SIGTERM or SIGHUP meanwhile raise Stopped, and leave
    no partial outputs (recipes/gpt/partial_outputs.py)."""
    tokenizer = build_tokenizer(tokenizer_spec, eod_token, options)
    check_inputs(inputs, output_prefix, replace, options)
    import_quietly()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(output_prefix)
    tmp = temporary_prefix(output_prefix)
    with partial_outputs(tmp) as commit:
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
        texts = (text for path in inputs for text in read_documents(path, text_key, text_document, options))
        documents, tokens = write_documents(builder, tokenizer, texts)
        builder.finalize(f"{tmp}.idx")
        if documents == 0:
            raise DataError(f"{options.input}: no documents in {', '.join(map(str, inputs))}")
        summary = {
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
            "tokenizer_sha256": getattr(tokenizer, "sha256", None),
            "documents": documents,
            "tokens": tokens,
            "sources": [str(p) for p in inputs],
            "text_key": text_key,
            "text_document": text_document,
        }
        Path(f"{tmp}.json").write_text(json.dumps(summary, indent=1))
        commit(output_prefix)
    return summary


def decode_document(prefix: Path, index: int, tokenizer_spec: Optional[str] = None) -> str:
    """Document `index` of an indexed dataset, as text (the tokenizer recorded in <prefix>.json by default)."""
    import_quietly()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    named = given("--decode", prefix)
    if tokenizer_spec is None:
        record = Path(f"{prefix}.json")
        if not record.is_file():
            raise DataError(f"{named}: {record}: no such file (it names the tokenizer); give --tokenizer")
        try:
            tokenizer_spec = json.loads(record.read_bytes())["tokenizer"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise DataError(f"{named}: {record}: names no tokenizer ({type(e).__name__}); give --tokenizer") from None
        if not isinstance(tokenizer_spec, str):
            raise DataError(f"{named}: {record}: names no tokenizer; give --tokenizer")
    tokenizer = build_tokenizer(tokenizer_spec, options=COMMAND_LINE)
    for suffix in (".bin", ".idx"):
        if not Path(f"{prefix}{suffix}").is_file():
            raise DataError(f"{named}: {prefix}{suffix}: no such file")
    try:
        dataset = IndexedDataset(str(prefix))
    except Exception as e:  # noqa: BLE001 (Megatron-Core asserts, numpy and struct errors)
        raise DataError(f"{named}: {prefix}.idx: unreadable ({type(e).__name__}: {e})") from None
    if not 0 <= index < len(dataset):
        raise DataError(f"--document {index}: out of range: {prefix} holds documents 0..{len(dataset) - 1}")
    ids = np.array(dataset[index])  # a copy: the item is a view into the memory map, closed with `dataset`
    return tokenizer.decode(ids)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help=".txt, .jsonl or .parquet files")
    parser.add_argument("--output-prefix", type=Path, help="writes <prefix>.bin, <prefix>.idx, <prefix>.json")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="byte (the default), or a local Hugging Face tokenizer "
        "folder; with --decode: the one the <prefix>.json names by default",
    )
    parser.add_argument("--eod-token", default=None, help="HF tokenizers: end-of-document token (default: eos)")
    parser.add_argument("--text-key", default="text", help=".jsonl key / .parquet column holding the text")
    parser.add_argument(
        "--text-document", default="paragraph", choices=TEXT_DOCUMENTS, help=".txt files: what one document is"
    )
    parser.add_argument("--decode", type=Path, metavar="PREFIX", help="print a document of PREFIX as text")
    parser.add_argument("--document", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.decode:
            sys.stdout.write(decode_document(args.decode, args.document, args.tokenizer) + "\n")
            return
        if not args.input or not args.output_prefix:
            parser.error("--input and --output-prefix are needed (or --decode PREFIX)")
        summary = preprocess(
            args.input, args.output_prefix, args.tokenizer or "byte", args.text_key, args.text_document, args.eod_token
        )
    except ConfigError as e:  # a bad input, option or tokenizer: named in one line
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except (Stopped, KeyboardInterrupt) as e:
        signum = stop_signal(e)
        written = "" if args.decode else f"; nothing was written to {args.output_prefix}"
        print(f"error: stopped by {signum.name}{written}", file=sys.stderr)
        raise SystemExit(128 + signum) from None  # the shell's code for an end by this signal
    print(f"wrote {summary['documents']} documents, {summary['tokens']} tokens to {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
