"""Do two training settings learn the same? Train each for N steps from the same seed and data order,
then compare the loss curves (e.g. FP8 against bf16).

    python benchmarks/loss_curves.py --config vit_base_patch16_224 --steps 200 --nproc 1 \
        --variant "bf16=" --variant "fp8_delayed=precision=fp8_delayed precision.param_dtype=bf16"

Prints, for every variant after the first, how many of its step losses equal the first variant's bit for bit
and the largest relative difference of one step's loss, the largest gap between its loss curve and the first
variant's, both smoothed over --window steps (absolute, and relative to the first variant's loss there),
the largest relative gap, and the final smoothed losses; writes the curves to JSON in benchmarks/results/ (and a
PNG with --plot, which needs matplotlib). `--replot RESULT.json --png FILE` draws the PNG of an earlier run's JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from train_runs import TrainRunFailed, run_train

REPO = Path(__file__).resolve().parents[1]


def train_losses(config: str, nproc: int, steps: int, overrides: list[str], timeout: float) -> list[float]:
    try:
        rows, _ = run_train(
            config, nproc, [f"training.steps={steps}", "training.log_every_n_steps=1", *overrides], timeout
        )
    except TrainRunFailed as e:
        raise SystemExit(str(e)) from None
    return [r["loss"] for r in rows if "split" not in r and "loss" in r]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict[str, list[float]], window: int, title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, losses in curves.items():
        (line,) = ax.plot(range(1, len(losses) + 1), smooth(losses, window), label=f"{name} ({window}-step mean)")
        ax.plot(range(1, len(losses) + 1), losses, alpha=0.2, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="vit_base_patch16_224")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variant", action="append", default=[], help='"name=override ..."; the first is the reference')
    p.add_argument("--extra", default="", help="overrides added to every variant (a variant's own win over them)")
    p.add_argument("--window", type=int, default=20, help="steps of smoothing before comparing")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--plot", action="store_true")
    p.add_argument("--replot", type=Path, help="a JSON this script wrote: only draw its PNG (to --png)")
    p.add_argument("--png", type=Path, help="with --replot: where the PNG goes")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p


def compare(name: str, losses: list[float], ref_name: str, ref_losses: list[float], window: int) -> dict:
    """How far `losses` is from the reference's: step by step (bits and relative difference) and between the
    `window`-step means; printed, and returned as the summary's entry."""
    ref, other = smooth(ref_losses, window), smooth(losses, window)
    gaps = [abs(a - b) for a, b in zip(other, ref)]
    rel = [g / abs(r) for g, r in zip(gaps, ref)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    worst_rel = max(range(len(rel)), key=rel.__getitem__)
    # Step by step, unsmoothed: how many losses are the same bits, and the largest relative difference.
    raw = list(zip(losses, ref_losses))
    identical = sum(a == b for a, b in raw)
    step_rel = max(abs(a - b) / abs(b) for a, b in raw)
    print(
        f"{name} vs {ref_name}: {identical} of {len(raw)} step losses identical; largest relative "
        f"difference of one step's loss {step_rel:.2e}"
    )
    print(
        f"{name} vs {ref_name}: largest gap of the {window}-step means {gaps[worst]:.4f} at step "
        f"{worst + 1} ({100 * rel[worst]:.2f}% of the loss there); largest relative gap "
        f"{100 * rel[worst_rel]:.2f}% at step {worst_rel + 1}; final {other[-1]:.4f} vs {ref[-1]:.4f}"
    )
    return {
        "max_abs_gap": gaps[worst],
        "at_step": worst + 1,
        "rel_gap_at_max_abs": rel[worst],
        "max_rel_gap": rel[worst_rel],
        "max_rel_at_step": worst_rel + 1,
        "final_smoothed": other[-1],
        "reference_final_smoothed": ref[-1],
        "identical_steps": identical,
        "steps_compared": len(raw),
        "max_step_rel_diff": step_rel,
    }


def save(args: argparse.Namespace, curves: dict[str, list[float]], summary: dict) -> None:
    """The curves and their comparison as JSON in --out (and the PNG with --plot)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path = out / f"loss_curves-{args.config}-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "config": args.config,
                "nproc": args.nproc,
                "date": stamp,
                "window": args.window,
                "command": " ".join(shlex.quote(a) for a in sys.argv),
                "curves": curves,
                "summary": summary,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    if args.plot:
        plot(curves, args.window, f"{args.config}, {args.nproc} process(es)", path.with_suffix(".png"))
    if os.environ.get("OUT"):  # on the device machine, also keep a copy where results come back from
        for f in (path, path.with_suffix(".png")):
            if f.exists():
                (Path(os.environ["OUT"]) / f.name).write_bytes(f.read_bytes())


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.replot:
        if not args.png:
            p.error("--replot needs --png")
        saved = json.loads(args.replot.read_text())
        plot(
            saved["curves"],
            saved["window"],
            f"{saved['config']}, {saved['nproc']} process(es), {saved['date']}",
            args.png,
        )
        return
    if len(args.variant) < 2:
        p.error("give at least two --variant")

    curves = {}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        curves[name] = train_losses(
            args.config, args.nproc, args.steps, shlex.split(args.extra) + shlex.split(overrides), args.timeout
        )
        print(
            f"{name}: {len(curves[name])} steps, first loss {curves[name][0]:.4f}, last {curves[name][-1]:.4f}",
            flush=True,
        )

    names = list(curves)
    summary = {name: compare(name, curves[name], names[0], curves[names[0]], args.window) for name in names[1:]}
    save(args, curves, summary)


if __name__ == "__main__":
    main()
