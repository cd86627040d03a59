"""Plot a run's curves against the optimizer step, from its metrics.jsonl.

    python -m core.metrics.plot RUN_DIR [--out FOLDER] [--dpi 100]     # FOLDER: RUN_DIR/plots by default

Writes one PNG per curve, and the same curves as the panels of one figure, curves.png:

    loss.png        training loss (a line) and validation loss (markers)
    lr.png          learning rate
    grad_norm.png   gradient norm before clipping
    throughput.png  samples/s per GPU; the right axis reads it in tokens/s per GPU where the two differ
    val_<name>.png  each other numeric validation metric: val_top1.png, val_top5.png, val_perplexity.png, ...

A curve the run never logged gets no file; the paths written are printed, one a line. Training records are
those without "split", validation records have "split": "val"; other splits (checkpoint stalls) are not
plotted. Lines that are not JSON objects with an integer "step" (a half-written last line after a crash) are
skipped and counted; of two records of one split and step, the later one counts.

Only this module imports matplotlib, and draws on its Agg canvas (no display, no pyplot state): training
never loads it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

TRAIN = "train"  # the split of records logged without one


@dataclass
class Line:
    label: str
    steps: list[int]
    values: list[float]
    marker: str | None = None


@dataclass
class Panel:
    name: str  # the file name, without .png
    ylabel: str
    lines: list[Line]
    tokens_per_sample: float | None = None  # throughput: the scale of its tokens/s axis


def read_records(path: Path) -> tuple[dict[str, list[dict]], int]:
    """Each split's records in step order, and how many non-blank lines were not records."""
    by_split: dict[str, dict[int, dict]] = {}
    skipped = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for json
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            skipped += 1
            continue
        by_split.setdefault(str(record.get("split", TRAIN)), {})[step] = record  # a repeated step: the last counts
    return {split: [steps[s] for s in sorted(steps)] for split, steps in by_split.items()}, skipped


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series(records: list[dict], key: str, label: str = "", marker: str | None = None) -> Line:
    """The records that hold a number under `key`; inf and nan become gaps (matplotlib cannot scale to inf)."""
    points = [(r["step"], float(r[key])) for r in records if _number(r.get(key))]
    return Line(label or key, [s for s, _ in points], [v if math.isfinite(v) else math.nan for _, v in points], marker)


def panels(records: dict[str, list[dict]]) -> list[Panel]:
    """The figures the records have data for, in the order of curves.png's panels."""
    train, val = records.get(TRAIN, []), records.get("val", [])
    # tokens/s is samples/s times a constant per run (1 for MNIST): a second scale, not a second curve.
    ratios = [
        r["tokens_per_sec_per_gpu"] / r["samples_per_sec_per_gpu"]
        for r in train
        if _number(r.get("tokens_per_sec_per_gpu"))
        and _number(r.get("samples_per_sec_per_gpu"))
        and r["samples_per_sec_per_gpu"] > 0
    ]
    ratio = statistics.median(ratios) if ratios else None
    found = [
        Panel("loss", "loss", [series(train, "loss", "train"), series(val, "loss", "val", "o")]),
        Panel("lr", "learning rate", [series(train, "lr")]),
        Panel("grad_norm", "gradient norm", [series(train, "grad_norm")]),
        Panel(
            "throughput",
            "samples/s per GPU",
            [series(train, "samples_per_sec_per_gpu")],
            ratio if ratio and abs(ratio - 1) > 1e-6 else None,
        ),
    ]
    val_keys = sorted({k for r in val for k, v in r.items() if _number(v)} - {"step", "loss"})
    found += [Panel(f"val_{k}", f"val {k}", [series(val, k, "val", "o")]) for k in val_keys]
    for panel in found:
        panel.lines = [line for line in panel.lines if line.steps]
    return [panel for panel in found if panel.lines]


def draw(ax, panel: Panel) -> None:
    """One panel on a matplotlib Axes."""
    for line in panel.lines:
        ax.plot(line.steps, line.values, marker=line.marker, markersize=4, label=line.label)
    if panel.tokens_per_sample:
        r = panel.tokens_per_sample
        ax.secondary_yaxis("right", functions=(lambda x: x * r, lambda y: y / r)).set_ylabel("tokens/s per GPU")
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if len(panel.lines) > 1:
        ax.legend()


def write_figures(found: list[Panel], out: Path, title: str, dpi: int = 100) -> list[Path]:
    """Each panel's PNG, then curves.png with all of them; returns the paths written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        written.append(out / f"{name}.png")
        fig.savefig(written[-1], dpi=dpi)

    for panel in found:
        fig = Figure(figsize=(6.4, 4), layout="constrained")
        ax = fig.add_subplot()
        draw(ax, panel)
        ax.set_title(title, fontsize=10)
        save(fig, panel.name)
    cols = min(3, len(found))
    rows = math.ceil(len(found) / cols)
    fig = Figure(figsize=(4.4 * cols, 3.2 * rows), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, panel in zip(axes, found):
        draw(ax, panel)
    for ax in axes[len(found) :]:  # the grid's empty cells
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    save(fig, "curves")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m core.metrics.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run directory, holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: RUN_DIR/plots)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch (default: 100)")
    args = parser.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    # parser.error: the message and exit code 2, like any other bad argument.
    if not args.run_dir.is_dir():
        parser.error(f"no run directory {args.run_dir}")
    if not metrics.is_file():
        parser.error(f"no metrics.jsonl in {args.run_dir} (logger.jsonl=false, or not a run directory?)")
    records, skipped = read_records(metrics)
    if skipped:
        print(f"skipped {skipped} line(s) of {metrics} that are not records (a half-written line?)", file=sys.stderr)
    found = panels(records)
    if not found:
        parser.error(f"no training or validation records to plot in {metrics}")
    absent = [name for name in ("loss", "lr", "grad_norm", "throughput") if name not in {p.name for p in found}]
    if absent:
        print(f"not logged by this run, no figure: {', '.join(absent)}", file=sys.stderr)
    title = "/".join(args.run_dir.resolve().parts[-2:])  # e.g. vit_sanity/2026-11-25_01-36-16
    for path in write_figures(found, args.out or args.run_dir / "plots", title, args.dpi):
        print(path)


if __name__ == "__main__":
    main()
