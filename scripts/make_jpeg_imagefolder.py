"""Write an ImageFolder of JPEGs with ImageNet-like sizes, to measure the JPEG input pipeline on a machine
that has no real image dataset (and no network).

Images are smooth random colour fields plus fine noise (so JPEG has real work, unlike flat images), with
sizes drawn around ImageNet's (shorter side 300-500 px, aspect 3:4 to 4:3), saved at quality 90:

    <out>/train/<class>/<index:06d>.jpg   <out>/val/<class>/<index:06d>.jpg

Seeded: reruns give identical files.

    python scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 5000 --val 500 --classes 10
    python benchmarks/input_pipeline.py --config vit_base_patch16_224 data=imagefolder data.root=/tmp/jpegs \
        data.num_classes=10 data.decode_on=device --device cuda --workers 2 4 8
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def write_image(args: tuple[Path, int, int]) -> None:
    path, seed, quality = args
    rng = np.random.default_rng(seed)
    short = int(rng.integers(300, 501))
    aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    h, w = (short, round(short * aspect)) if aspect >= 1 else (round(short / aspect), short)
    coarse = rng.integers(0, 256, (h // 32 + 2, w // 32 + 2, 3)).astype(np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
    pixels = np.clip(field + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=quality)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=5000, help="training images in all")
    p.add_argument("--val", type=int, default=500)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    if args.out.exists() and any(args.out.iterdir()):  # its files would be overwritten
        sys.exit(f"{args.out} is not empty; choose a new folder (nothing was written)")
    jobs = []
    for split, count, offset in (("train", args.train, 0), ("val", args.val, args.train)):
        for i in range(count):
            folder = args.out / split / f"class{i % args.classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{i:06d}.jpg", args.seed * 10_000_019 + offset + i, args.quality))
    with ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(write_image, jobs, chunksize=64))
    print(f"wrote {len(jobs)} JPEGs under {args.out}")


if __name__ == "__main__":
    main()
