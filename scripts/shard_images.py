"""Write an image dataset (ImageFolder or Tiny-ImageNet layout) into tar shards with an index, for
`data.format=shards` (recipes/vit/shards.py).

    python scripts/shard_images.py --root data/digits --out /tmp/digits_shards
    python scripts/shard_images.py --root /data/imagenet --out /data/imagenet_shards --shorter-side 256
    torchrun --nproc-per-node 8 train.py --config-name vit_base_patch16_224 data=imagefolder \\
        data.format=shards data.root=/data/imagenet_shards

The classes and each split's images are found as training finds them (unreadable files left out, logged);
with --shorter-side the images are resized so (never enlarged) and stored as JPEG. Prints each split's
samples and shards. A dataset that cannot be used, or an --out that cannot be written, ends with one line
`error: ...` naming the file (and --root or --out), exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config.errors import DataError  # noqa: E402
from recipes.vit.config import ImageDataConfig, ImageFormat  # noqa: E402
from recipes.vit.data import image_classes, named, split_files  # noqa: E402
from recipes.vit.shards import write_shards  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="the dataset's folder (or a .tar.gz beside a missing one)")
    parser.add_argument("--format", choices=("imagefolder", "tiny_imagenet"), default="imagefolder")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], help="the splits to write, if there")
    parser.add_argument("--samples-per-shard", type=int, default=5000)
    parser.add_argument("--shorter-side", type=int, default=None, help="resize so (JPEG); default: bytes as they are")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality with --shorter-side")
    args = parser.parse_args()
    if (
        args.samples_per_shard < 1
        or (args.shorter_side is not None and args.shorter_side < 1)
        or not 1 <= args.quality <= 100
    ):
        parser.error("--samples-per-shard and --shorter-side must be at least 1, --quality within 1-100")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written, classes = shard(args)
    except ValueError as e:  # DataError: a file of --root; ValueError: --out or --splits
        fail(str(e))
    except OSError as e:  # --out cannot be written
        fail(f"--out {args.out}: {e}")
    for split, shards in written.items():
        print(
            f"{split}: {len(shards)} samples of {len(classes)} classes in {len(shards.shards)} shards "
            f"({shards.shards[0].name} ...)"
        )
    print(f"wrote {args.out}; train from it with data.format=shards data.root={args.out}")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def shard(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The dataset of --root written into shards under --out: the splits as read back, and the classes."""
    given = f"--root {args.root}"
    data = ImageDataConfig(format=ImageFormat(args.format), root=args.root)
    classes = image_classes(data, given)
    splits = {}
    for split in args.splits:
        files = split_files(data, split, classes, given)
        if files is None:
            print(f"{args.root}: no split {split!r}; left out")
            continue
        splits[split] = files
    if not splits:
        raise DataError(f"{given}: none of the splits {args.splits} is there")
    with named(given):  # an image that cannot be read is a file of --root
        written = write_shards(args.out, classes, splits, args.samples_per_shard, args.shorter_side, args.quality)
    return written, classes


if __name__ == "__main__":
    main()
