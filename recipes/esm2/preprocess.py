"""Protein sequences into the ESM-2 recipe's memory-mapped store, for datasets too large to read at every start.

    python -m recipes.esm2.preprocess --input uniref90.fasta.gz --out /data/uniref90_store
    python -m recipes.esm2.preprocess --input shards/ --column sequence --name-column id --out /data/store

Inputs: what `data.path` takes (recipes/esm2/sources.py: FASTA, parquet, CSV/TSV, Arrow, `datasets` folders,
folders and patterns of them), read in order and tokenized (letters outside the ESM-2 vocabulary become <unk>;
empty sequences are left out; both are counted and printed). The output folder (residues.bin, offsets.npy,
names.txt, index.json) is what `data.path` takes; it appears complete or not at all: it is written into
`<out>.partial-<pid>` and renamed when complete. An existing `--out`, or one another run is writing, is refused;
a failure, Ctrl-C, SIGTERM or SIGHUP (unless ignored, as under nohup) removes this run's partial folder (after
SIGKILL, the next run to the same `--out` removes it, saying so). Memory: 8 bytes per sequence.

A bad input or output is one line `error: ...` naming the option and the file, exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Optional

from core.config.errors import ConfigError
from core.data.partial_outputs import Stopped, stop_signal
from recipes.esm2.sequences import write_store
from recipes.esm2.sources import SourceKeys, records

KEYS = SourceKeys(path="--input", column="--column", split="--split")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", type=Path, required=True, help="files or folders of sequences")
    parser.add_argument("--out", type=Path, required=True, help="the store's folder (must not exist)")
    parser.add_argument("--column", default="sequence", help="parquet / CSV / datasets: the sequences' column")
    parser.add_argument("--name-column", default="id", help="... and their names' (missing: row numbers)")
    parser.add_argument("--split", default="train", help="a datasets DatasetDict folder: the split")
    args = parser.parse_args(argv)
    try:
        named = itertools.chain.from_iterable(
            records(p, args.column, args.name_column, args.split, KEYS) for p in args.input
        )
        index = write_store(
            named,
            args.out,
            ", ".join(map(str, args.input)),
            named="--input " + " ".join(map(str, args.input)),
            option="--out",
            say=lambda note: print(f"note: {note}", file=sys.stderr),
        )
    except ConfigError as e:  # DataError included: a file or option the user can fix
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # disk full, permissions
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except (Stopped, KeyboardInterrupt) as e:  # SIGTERM, SIGHUP (unless ignored, as under nohup), Ctrl-C
        signum = stop_signal(e)
        print(f"error: stopped by {signum.name}; nothing was written", file=sys.stderr)
        raise SystemExit(128 + signum) from None  # the shell's code for an end by this signal
    print(
        f"wrote {index['sequences']} sequences, {index['residues']} residues to {args.out} "
        f"(train with data.path={args.out})"
    )
    if index["notes"]:
        print(f"note: {index['notes']}")


if __name__ == "__main__":
    main()
