"""Build a small ImageFolder dataset from scikit-learn's bundled UCI digits.

The 1,797 8x8 images (values 0..16, 10 classes) ship inside scikit-learn, so
this needs no download. Each image is upscaled to SIZE x SIZE grayscale PNG and
written as:

    <out>/train/<digit>/<index:04d>.png
    <out>/val/<digit>/<index:04d>.png

<index> is the sample's position in ``load_digits()``, so every file can be
traced back to the source. The split is stratified by class and seeded, and
the PNGs carry no metadata, so reruns give byte-identical files.

Usage:
    python scripts/make_digits_imagefolder.py [--out data/digits] [--size 28]
        [--val-fraction 0.2] [--seed 0]
"""

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

CLASSES = [str(d) for d in range(10)]


def stratified_split(labels, val_fraction, seed):
    """Return sorted (train_idx, val_idx); each class keeps the same val share."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in range(10):  # fixed class order so the RNG stream is reproducible
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = round(len(idx) * val_fraction)
        val.extend(idx[:n_val])
        train.extend(idx[n_val:])
    return np.sort(train), np.sort(val)


def to_image(pixels, size):
    """8x8 array in 0..16 -> size x size 'L' image in 0..255."""
    # Scale to 0..255 before resizing so interpolation works on the full 8-bit
    # range; a 2-D uint8 array becomes a mode "L" image.
    small = Image.fromarray(np.round(pixels * 255.0 / 16.0).astype(np.uint8))
    return small.resize((size, size), Image.Resampling.BICUBIC)


def write_split(out, split, indices, images, labels, size):
    counts = {c: 0 for c in CLASSES}
    for i in indices:
        label = CLASSES[labels[i]]
        path = out / split / label / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        # No pnginfo is passed and optimize=False, so the bytes depend only on pixels.
        to_image(images[i], size).save(path, format="PNG", optimize=False)
        counts[label] += 1
    return counts


def write_readme(out, command, size, counts):
    rows = "\n".join(
        f"| {c} | {counts['train'][c]} | {counts['val'][c]} | {counts['train'][c] + counts['val'][c]} |"
        for c in CLASSES
    )
    totals = {s: sum(counts[s].values()) for s in ("train", "val")}
    (out / "README.md").write_text(f"""# UCI hand-written digits (ImageFolder, {size}x{size})

## Source

Optical Recognition of Handwritten Digits, UCI Machine Learning Repository,
E. Alpaydin and C. Kaynak, 1998 (https://doi.org/10.24432/C50P49,
https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits).
Taken from the copy bundled with scikit-learn (`sklearn.datasets.load_digits`,
the 1,797-image 8x8 test set with values 0..16).

## Licence

The UCI dataset is licensed under CC BY 4.0
(https://creativecommons.org/licenses/by/4.0/); **attribution is required** when
redistributing or using it: cite Alpaydin and Kaynak (1998) and the UCI
Machine Learning Repository as above. scikit-learn, which distributes the copy
used here, is BSD-3-Clause.

## How it was made

```
{command}
```

Each 8x8 image was rescaled from 0..16 to 0..255 (uint8), upscaled to
{size}x{size} with Pillow bicubic resampling, and saved as a grayscale
(mode `L`) PNG without metadata. The train/val split is stratified by class,
using `numpy.random.default_rng(seed)`. File names are the sample's index in
`load_digits()`. Rerunning the command produces byte-identical files.

## Layout and counts

`train/<digit>/<index>.png` and `val/<digit>/<index>.png`, classes `0`..`9`.
Images: {size}x{size}, mode `L` (8-bit grayscale), PNG.

| class | train | val | total |
|---|---|---|---|
{rows}
| **all** | {totals["train"]} | {totals["val"]} | {totals["train"] + totals["val"]} |
""")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/digits"))
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    for split in ("train", "val"):
        # Refuse to mix with an earlier run, which could leave stale files behind.
        if (args.out / split).exists() and any((args.out / split).rglob("*.png")):
            sys.exit(f"{args.out / split} already has PNGs; remove it first")

    digits = load_digits()
    train_idx, val_idx = stratified_split(digits.target, args.val_fraction, args.seed)
    counts = {
        "train": write_split(args.out, "train", train_idx, digits.images, digits.target, args.size),
        "val": write_split(args.out, "val", val_idx, digits.images, digits.target, args.size),
    }
    command = "python scripts/make_digits_imagefolder.py " + shlex.join(
        [
            "--out",
            str(args.out),
            "--size",
            str(args.size),
            "--val-fraction",
            str(args.val_fraction),
            "--seed",
            str(args.seed),
        ]
    )
    write_readme(args.out, command, args.size, counts)
    for split, c in counts.items():
        print(split, sum(c.values()), c)


if __name__ == "__main__":
    main()
