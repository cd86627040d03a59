"""Tokenize text into Megatron's indexed dataset format (<prefix>.bin + <prefix>.idx) for GPTDataset.

    python -m recipes.gpt.preprocess --input books/*.txt docs.jsonl table.parquet --output-prefix data/corpus \
        [--tokenizer byte | /path/to/hf_tokenizer] [--text-key text] [--text-document paragraph|line|file]

Inputs by suffix: .txt (documents are paragraphs, separated by blank lines; or lines; or whole files),
.jsonl (one JSON object per line, the document in --text-key), .parquet (the --text-key column; needs
pyarrow). Every document is tokenized and followed by the end-of-document token. Also writes
<prefix>.json with the tokenizer, counts and sources. The files appear complete or not at all.

    python -m recipes.gpt.preprocess --decode data/corpus --document 3     # print document 3 back as text
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from recipes.gpt.tokenizer import build_tokenizer, lone_surrogate

TEXT_DOCUMENTS = ("paragraph", "line", "file")


def read_documents(path: Path, text_key: str = "text", text_document: str = "paragraph") -> Iterator[str]:
    """The documents of one input file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark is no text
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text (byte {e.start} of the file: {e.reason}); is it a "
                             "binary file?") from None
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # Windows and old Mac line ends, as Python's text mode
        if text_document == "file":
            parts = [text]
        elif text_document == "line":
            parts = text.split("\n")  # line ends only: a form feed or U+2028 inside a line does not split it
        elif text_document == "paragraph":
            parts = re.split(r"\n\s*\n", text)
        else:
            raise ValueError(f"--text-document={text_document!r}: expected one of {', '.join(TEXT_DOCUMENTS)}")
        yield from (p.strip("\n") for p in parts if p.strip())
    elif suffix == ".jsonl":
        with open(path, "rb") as f:
            for number, raw_line in enumerate(f, 1):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{number}: not UTF-8 text (byte {e.start} of the line: {e.reason}); is it "
                                     "a binary file?") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    raise ValueError(f"{path}:{number}: not JSON ({type(e).__name__}: {str(e)[:100]})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise ValueError(f"{path}:{number}: no text under the key {text_key!r}")
                text = record[text_key]
                if lone_surrogate(text):
                    raise ValueError(f"{path}:{number}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff): "
                                     "not text any tokenizer encodes")
                yield text
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from None
        try:
            table = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 (pyarrow's errors are of its own types)
            raise ValueError(f"{path}: unreadable as parquet ({type(e).__name__}: {e})") from None
        if text_key not in table.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_key!r} (columns: {', '.join(table.schema_arrow.names)})")
        row = 0
        for batch in table.iter_batches(columns=[text_key]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):  # a null or a number: as a .jsonl line without text, refused
                    raise ValueError(f"{path}: row {row}: no text in the column {text_key!r} ({text!r:.40})")
                if text:
                    yield text
                row += 1
    else:
        raise ValueError(f"{path}: unknown input type {suffix!r} (expected .txt, .jsonl or .parquet)")


def preprocess(inputs: list[Path], output_prefix: Path, tokenizer_spec: str = "byte", text_key: str = "text",
               text_document: str = "paragraph", eod_token: Optional[str] = None, replace: bool = False) -> dict:
    """Write <output_prefix>.bin/.idx/.json; return the summary that goes into the .json. Existing outputs are
    refused unless `replace` (the tokenize-on-first-use cache, which owns its prefix)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = build_tokenizer(tokenizer_spec, eod_token)
    for path in inputs:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such input file" + (" (a folder: give its files)" if path.is_dir()
                                                                     else ""))
        if path.suffix.lower() not in (".txt", ".jsonl", ".parquet"):
            raise ValueError(f"{path}: unknown input type {path.suffix!r} (expected .txt, .jsonl or .parquet)")
    times = Counter(p.resolve() for p in inputs)
    repeated = sorted({str(p) for p in inputs if times[p.resolve()] > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)}: given twice (its documents would be trained on twice)")
    existing = [f"{output_prefix}{suffix}" for suffix in (".bin", ".idx", ".json") if Path(f"{output_prefix}{suffix}").exists()]
    if existing and not replace:
        raise FileExistsError(f"{', '.join(existing)} exist; choose another --output-prefix (or remove them)")
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_prefix.with_name(f"{output_prefix.name}.tmp-{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    documents = tokens = 0
    try:
        for path in inputs:
            for text in read_documents(path, text_key, text_document):
                ids = np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int64)
                builder.add_document(ids, [len(ids)])
                documents, tokens = documents + 1, tokens + len(ids)
        builder.finalize(f"{tmp}.idx")
        if documents == 0:
            raise ValueError(f"no documents in {', '.join(map(str, inputs))}")
        summary = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                   "tokenizer_sha256": getattr(tokenizer, "sha256", None),
                   "documents": documents, "tokens": tokens, "sources": [str(p) for p in inputs],
                   "text_key": text_key, "text_document": text_document}
        Path(f"{tmp}.json").write_text(json.dumps(summary, indent=1))
        for suffix in (".bin", ".idx", ".json"):  # the .json last: its presence means the others are whole
            os.replace(f"{tmp}{suffix}", f"{output_prefix}{suffix}")
    finally:
        for suffix in (".bin", ".idx", ".json"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    return summary


def decode_document(prefix: Path, index: int, tokenizer_spec: Optional[str] = None) -> str:
    """Document `index` of an indexed dataset, as text (the tokenizer recorded in <prefix>.json by default)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if tokenizer_spec is None:
        record = Path(f"{prefix}.json")
        if not record.is_file():
            raise FileNotFoundError(f"{record}: no such file (it names the tokenizer); give --tokenizer")
        tokenizer_spec = json.loads(record.read_text())["tokenizer"]
    tokenizer = build_tokenizer(tokenizer_spec)
    dataset = IndexedDataset(str(prefix))
    if not 0 <= index < len(dataset):
        raise ValueError(f"{prefix}: document {index} out of range (0..{len(dataset) - 1})")
    ids = np.array(dataset[index])  # a copy: the item is a view into the memory map, closed with `dataset`
    return tokenizer.decode(ids)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, help=".txt, .jsonl or .parquet files")
    parser.add_argument("--output-prefix", type=Path, help="writes <prefix>.bin, <prefix>.idx, <prefix>.json")
    parser.add_argument("--tokenizer", default=None, help="byte (the default), or a local Hugging Face tokenizer "
                        "folder; with --decode: the one the <prefix>.json names by default")
    parser.add_argument("--eod-token", default=None, help="HF tokenizers: end-of-document token (default: eos)")
    parser.add_argument("--text-key", default="text", help=".jsonl key / .parquet column holding the text")
    parser.add_argument("--text-document", default="paragraph", choices=TEXT_DOCUMENTS,
                        help=".txt files: what one document is")
    parser.add_argument("--decode", type=Path, metavar="PREFIX", help="print a document of PREFIX as text")
    parser.add_argument("--document", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.decode:
            sys.stdout.write(decode_document(args.decode, args.document, args.tokenizer) + "\n")
            return
        if not args.input or not args.output_prefix:
            parser.error("--input and --output-prefix are needed (or --decode PREFIX)")
        summary = preprocess(args.input, args.output_prefix, args.tokenizer or "byte", args.text_key, args.text_document,
                             args.eod_token)
    except (OSError, ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {summary['documents']} documents, {summary['tokens']} tokens to {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
