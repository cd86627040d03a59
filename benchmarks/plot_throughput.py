"""Plot throughput per GPU against micro-batch size from benchmarks/throughput.py JSON files.

    pip install matplotlib==3.10.7   # only this script needs it
    python benchmarks/plot_throughput.py benchmarks/results/<folder>/vit_*.json --out docs/vit_throughput.png

One line per variant name (rows of the same variant from several files are joined, so give files from
one campaign); the y axis is images/s per GPU, or tokens/s per GPU for language models.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default=None)
    p.add_argument("--tokens", action="store_true", help="plot tokens/s instead of samples/s")
    p.add_argument("--rename", action="append", default=[], metavar="VARIANT=LABEL", help="legend label of a variant")
    args = p.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("this script needs matplotlib: pip install matplotlib==3.10.7") from None

    labels = dict(r.split("=", 1) for r in args.rename)
    lines: dict[str, dict[int, float]] = defaultdict(dict)
    devices, configs = set(), set()
    for path in args.files:
        run = json.loads(path.read_text())
        devices.add(f"{run['nproc']} x {run['device']}")
        configs.add(run["config"])
        for row in run["results"]:
            if "error" in row:
                continue
            rate = row["tokens_per_sec_per_gpu"] if args.tokens else row["samples_per_sec_per_gpu"]
            lines[labels.get(row["variant"], row["variant"])][row["micro_batch"]] = rate
    if not lines:
        raise SystemExit("no successful rows in the given files")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(lines.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({x for pts in lines.values() for x in pts}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel(("tokens" if args.tokens else "samples") + "/s per GPU")
    ax.set_title(args.title or f"{', '.join(sorted(configs))} on {', '.join(sorted(devices))}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
