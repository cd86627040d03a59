"""Plot throughput per GPU from benchmarks/throughput.py JSON files.

    pip install matplotlib   # the version in requirements.txt; only the plots need it
    python benchmarks/plot_throughput.py benchmarks/results/<folder>/vit_*.json --out docs/vit_throughput.png

By micro-batch size: one line per variant name (rows of the same variant from several files are joined, so
give files from one campaign); the y axis is images/s per GPU, or tokens/s per GPU for language models.
--bars BASELINE[=PREFIX] (repeatable): one bar per row instead (variants at one micro-batch size), each
labelled with its ratio to a baseline row of the same file (real data against synthetic, measured in the same
run): the baseline whose PREFIX begins the variant's name, the longest such (no PREFIX: every variant), e.g.
--bars synthetic --bars fp8_synthetic=fp8_.
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
    p.add_argument(
        "--bars",
        metavar="BASELINE[=PREFIX]",
        action="append",
        default=[],
        help="bars, with each row's ratio to a baseline row in the same file (see above)",
    )
    args = p.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "this script needs matplotlib: pip install matplotlib (the version in requirements.txt)"
        ) from None

    labels = dict(r.split("=", 1) for r in args.rename)
    if args.bars:
        return plot_bars(plt, args, labels)
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
    save(fig, args.out)


def save(fig, out: Path) -> None:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def bar_rows(runs: dict[str, dict], bars: list[str], key: str, labels: dict[str, str]) -> list[tuple]:
    """(label, rate, ratio to its baseline) per successful row of each run (file name -> throughput.py JSON)."""
    baselines = [(b.split("=", 1) + [""])[:2] for b in bars]  # [variant, prefix]
    rows = []
    for path, run in runs.items():
        good = [r for r in run["results"] if "error" not in r]
        rates = {r["variant"]: r[key] for r in good}
        stamp = run["date"][11:16].replace("-", ":") if len(runs) > 1 else ""
        for row in good:
            matching = [(len(prefix), base) for base, prefix in baselines if row["variant"].startswith(prefix)]
            if not matching:
                raise SystemExit(f"{path}: no --bars baseline for the variant {row['variant']!r}")
            base = max(matching)[1]
            if base not in rates:
                raise SystemExit(f"{path}: no successful row of the baseline variant {base!r}")
            name = labels.get(row["variant"], row["variant"])
            rows.append((f"{name} ({stamp})" if stamp else name, row[key], row[key] / rates[base]))
    return rows


def plot_bars(plt, args, labels: dict[str, str]) -> None:
    runs = {str(path): json.loads(path.read_text()) for path in args.files}
    rows = bar_rows(runs, args.bars, "tokens_per_sec_per_gpu" if args.tokens else "samples_per_sec_per_gpu", labels)
    devices = {f"{run['nproc']} x {run['device']}" for run in runs.values()}
    configs = {run["config"] for run in runs.values()}
    fig, ax = plt.subplots(figsize=(7.5, 0.38 * len(rows) + 1.4))
    ax.barh(range(len(rows)), [r[1] for r in rows], color=["0.6" if r[2] == 1 else "tab:blue" for r in rows])
    for i, (_, rate, ratio) in enumerate(rows):
        ax.text(rate, i, f" {ratio:.2f}x", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(("tokens" if args.tokens else "samples") + "/s per GPU; ratio to its baseline (grey) of the same run")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x / 1e3:,.0f}k" if x >= 1e4 else f"{x:,.0f}"))
    ax.set_xlim(0, max(r[1] for r in rows) * 1.15)
    ax.set_title(args.title or f"{', '.join(sorted(configs))} on {', '.join(sorted(devices))}", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    save(fig, args.out)


if __name__ == "__main__":
    main()
