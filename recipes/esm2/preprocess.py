"""Protein sequences into the ESM-2 recipe's memory-mapped store, for datasets too large to read at every start.

    python -m recipes.esm2.preprocess --input uniref90.fasta.gz --out /data/uniref90_store
    python -m recipes.esm2.preprocess --input shards/ --column sequence --name-column id --out /data/store

Inputs: what `data.path` takes (recipes/esm2/sources.py: FASTA, parquet, CSV/TSV, Arrow, `datasets` folders,
folders and patterns of them), read in order and tokenized (letters outside the ESM-2 vocabulary become <unk>;
empty sequences are left out; both are counted and printed). The output folder (residues.bin, offsets.npy, names.txt, index.json) is what `data.path` takes;
it appears complete or not at all. Memory: 8 bytes per sequence.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Optional

from core.config.errors import ConfigError
from recipes.esm2.sequences import write_store
from recipes.esm2.sources import records


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, required=True, help="files or folders of sequences")
    parser.add_argument("--out", type=Path, required=True, help="the store's folder (must not exist)")
    parser.add_argument("--column", default="sequence", help="parquet / CSV / datasets: the sequences' column")
    parser.add_argument("--name-column", default="id", help="... and their names' (missing: row numbers)")
    parser.add_argument("--split", default="train", help="a datasets DatasetDict folder: the split")
    args = parser.parse_args(argv)
    try:
        named = itertools.chain.from_iterable(records(p, args.column, args.name_column, args.split) for p in args.input)
        index = write_store(named, args.out, ", ".join(map(str, args.input)))
    except (OSError, ValueError, ConfigError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {index['sequences']} sequences, {index['residues']} residues to {args.out} "
          f"(train with data.path={args.out})")
    if index["notes"]:
        print(f"note: {index['notes']}")


if __name__ == "__main__":
    main()
