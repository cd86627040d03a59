"""Build data/esm2_finetune_sanity/: a SANITY task for the esm2_finetune recipe, labels computed from each sequence.

    python scripts/make_esm2_finetune_sanity.py [--out data/esm2_finetune_sanity]

Not biology: every label is a fixed rule of the sequence itself (data/esm2_finetune_sanity/README.md), so a model
that learns it shows that the heads, packing, cropping and metrics work, nothing more. Sequences: the 1,000 of
data/uniref90_sample/uniref90_1000.parquet, each cut to its first 126 residues (so that model.max_seq_length=128
sees them whole); rows 1-800 train, 801-900 val, 901-1000 test.
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "data" / "uniref90_sample" / "uniref90_1000.parquet"
RESIDUES = 126
SPLITS = (("train", 0, 800), ("val", 800, 900), ("test", 900, 1000))
HYDROPHOBIC, HELIX, STRAND = set("AVILMFWC"), set("ALEMQKR"), set("VIYFWTC")
GLYCOSYLATION = re.compile(r"N[^P][ST]")
COLUMNS = (
    "id",
    "sequence",
    "hydrophobic_fraction",
    "net_charge",
    "charge_class",
    "glyco_motif",
    "cys_pair",
    "proline_rich",
    "structure",
)


def net_charge(sequence: str) -> float:
    """(K + R - D - E) per residue."""
    return (sum(c in "KR" for c in sequence) - sum(c in "DE" for c in sequence)) / len(sequence)


def structure(sequence: str) -> str:
    """A Q3-style letter per residue from its window of 7 (itself and 3 each side): H where 4+ are helix formers
    (A L E M Q K R) and they outnumber strand formers (V I Y F W T C), E where 3+ are strand formers and they
    outnumber helix formers, else C."""
    letters = []
    for i in range(len(sequence)):
        window = sequence[max(0, i - 3) : i + 4]
        helix, strand = sum(c in HELIX for c in window), sum(c in STRAND for c in window)
        letters.append("H" if helix >= 4 and helix > strand else "E" if strand >= 3 and strand > helix else "C")
    return "".join(letters)


def labels(identifier: str, full: str) -> list:
    s = full[:RESIDUES]
    charge = net_charge(s)
    return [
        identifier,
        s,
        f"{sum(c in HYDROPHOBIC for c in s) / len(s):.6f}",
        f"{charge:.6f}",
        "acidic" if charge < -0.02 else "basic" if charge > 0.015 else "neutral",
        int(GLYCOSYLATION.search(s) is not None),
        int(s.count("C") >= 2),
        int(s.count("P") / len(s) >= 0.06),
        structure(s),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "data" / "esm2_finetune_sanity")
    args = parser.parse_args(argv)
    table = pq.read_table(SOURCE, columns=["id", "sequence"]).to_pylist()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, start, end in SPLITS:
        with open(args.out / f"{split}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(COLUMNS)
            for row in table[start:end]:
                writer.writerow(labels(row["id"], row["sequence"]))
    print(f"wrote {', '.join(f'{s}.csv ({e - b} rows)' for s, b, e in SPLITS)} to {args.out}")


if __name__ == "__main__":
    main()
