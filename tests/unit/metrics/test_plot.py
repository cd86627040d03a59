"""python -m core.metrics.plot: a run's metrics.jsonl into PNG curves, on a hand-written history and on a
short real training run; and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.metrics import plot
from tests.support.helpers import REPO, run_python

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_history(run_dir: Path) -> Path:
    """Train steps 1..20 (no grad_norm), val every 5 steps, a checkpoint record, a repeated val step, and a
    half-written last line."""
    lines = [
        {
            "step": s,
            "loss": 3.0 - 0.1 * s,
            "lr": 1e-3 * s / 20,
            "samples_per_sec_per_gpu": 100.0 + s,
            "tokens_per_sec_per_gpu": 65 * (100.0 + s),
        }
        for s in range(1, 21)
    ]
    for s in (5, 10, 15, 20):
        lines.append({"step": s, "loss": 2.9 - 0.1 * s, "top1": s / 25, "split": "val"})
    lines.append({"step": 20, "stall_s": 0.1, "split": "checkpoint"})
    lines.append({"step": 20, "loss": 0.5, "top1": 0.9, "split": "val"})  # the same step again: this one counts
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 21, "loss": 0.')
    return metrics


def _check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 300 and height >= 200, (path, width, height)


def test_records_and_series_of_a_hand_written_history(tmp_path):
    records, skipped = plot.read_records(_write_history(tmp_path))
    assert skipped == 1
    assert sorted(records) == ["checkpoint", "train", "val"]
    assert [r["step"] for r in records["val"]] == [5, 10, 15, 20] and records["val"][-1]["top1"] == 0.9
    found = {p.name: p for p in plot.panels(records)}
    assert list(found) == ["loss", "lr", "throughput", "val_top1"]  # no grad_norm logged, no figure
    train, val = found["loss"].lines
    assert (train.label, train.steps, val.label, val.steps) == ("train", list(range(1, 21)), "val", [5, 10, 15, 20])
    assert val.values[-1] == 0.5
    assert found["throughput"].tokens_per_sample == pytest.approx(65)


def test_a_line_nested_too_deeply_is_skipped_as_no_record(tmp_path):
    metrics = _write_history(tmp_path)
    with metrics.open("a") as f:
        f.write("\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert plot.read_records(metrics)[1] == 2  # the half-written line and this one (a RecursionError before)


def test_the_figures_of_a_hand_written_history(tmp_path):
    from matplotlib.figure import Figure

    _write_history(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "core.metrics.plot", str(tmp_path), "--out", str(tmp_path / "png")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    names = ["loss", "lr", "throughput", "val_top1", "curves"]
    assert proc.stdout.split() == [str(tmp_path / "png" / f"{n}.png") for n in names]
    assert "skipped 1 line" in proc.stderr and "no figure: grad_norm" in proc.stderr
    for name in names:
        _check_png(tmp_path / "png" / f"{name}.png")
    assert not (tmp_path / "png" / "grad_norm.png").exists() and not (tmp_path / "plots").exists()
    # What draw() puts on the axes: every record a point, the validation loss with markers.
    ax = Figure().add_subplot()
    plot.draw(ax, plot.panels(plot.read_records(tmp_path / "metrics.jsonl")[0])[0])
    train, val = ax.get_lines()
    assert list(train.get_xdata()) == list(range(1, 21)) and list(val.get_xdata()) == [5, 10, 15, 20]
    assert val.get_marker() == "o" and list(val.get_ydata())[-1] == 0.5


@pytest.mark.slow
def test_plots_a_short_training_run(tmp_path):
    tiny = [
        "data.num_workers=0",
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "training.global_batch_size=8",
        "training.micro_batch_size=8",
        "training.log_every_n_steps=1",
        "logger.progress_bar=never",
        "training.steps=6",
        "training.val_every_n_steps=3",
        "hydra.run.dir=run",
    ]
    proc = run_python(REPO / "train.py", "--config-name", "vit_sanity", *tiny, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "core.metrics.plot", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    names = ["loss", "lr", "grad_norm", "throughput", "val_top1", "val_top5", "curves"]
    assert proc.stdout.split() == [str(run_dir / "plots" / f"{n}.png") for n in names]
    assert proc.stderr == ""  # nothing skipped, nothing absent
    for name in names:
        _check_png(run_dir / "plots" / f"{name}.png")
    train, val = {p.name: p for p in plot.panels(plot.read_records(run_dir / "metrics.jsonl")[0])}["loss"].lines
    assert train.steps == [1, 2, 3, 4, 5, 6] and val.steps == [3, 6]


@pytest.mark.slow
def test_training_never_imports_matplotlib():
    code = "import sys, train, core.metrics.plot; assert 'matplotlib' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no run directory"),
        ("empty", "no metrics.jsonl in"),
        ("garbage", "no training or validation records"),
    ],
)
def test_errors_exit_2_with_a_message(tmp_path, case, message):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
    if case == "garbage":  # half-written lines, a step that is not an integer, only checkpoint records
        (run_dir / "metrics.jsonl").write_text(
            '{"step": 1, "lo\n[1, 2]\n{"step": "3", "loss": 1.0}\n{"step": 4, "stall_s": 0.2, "split": "checkpoint"}\n'
        )
    proc = subprocess.run(
        [sys.executable, "-m", "core.metrics.plot", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr)
    assert not (run_dir / "plots").exists()


def test_throughput_bars_give_each_row_its_baselines_ratio(tmp_path):
    """benchmarks/plot_throughput.py --bars: a bar per row, FP8 rows against the FP8 baseline of their own
    file; a file without the baseline row is an error naming it."""

    def run_file(name, rates, date):
        rows = [
            {"variant": v, "micro_batch": 256, "samples_per_sec_per_gpu": r, "tokens_per_sec_per_gpu": 197 * r}
            for v, r in rates.items()
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"config": "vit", "device": "GPU", "nproc": 1, "date": date, "results": rows}))
        return path

    a = run_file(
        "a.json",
        {"synthetic": 4000.0, "folder": 3000.0, "fp8_synthetic": 5000.0, "fp8_folder": 4000.0},
        "2026-11-26_12-51-51",
    )
    b = run_file("b.json", {"fp8_synthetic": 4000.0, "fp8_folder": 4000.0}, "2026-11-26_12-56-44")
    script = [sys.executable, str(REPO / "benchmarks" / "plot_throughput.py")]
    bars = ["--bars", "synthetic", "--bars", "fp8_synthetic=fp8_"]
    out = tmp_path / "bars.png"
    proc = subprocess.run(script + [str(a), str(b), "--out", str(out)] + bars, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)
    from benchmarks.plot_throughput import bar_rows

    runs = {str(p): json.loads(p.read_text()) for p in (a, b)}
    rows = bar_rows(runs, ["synthetic", "fp8_synthetic=fp8_"], "samples_per_sec_per_gpu", {"folder": "JPEGs"})
    assert [(label, ratio) for label, _, ratio in rows] == [
        ("synthetic (12:51)", 1.0),
        ("JPEGs (12:51)", 0.75),
        ("fp8_synthetic (12:51)", 1.0),
        ("fp8_folder (12:51)", 0.8),
        ("fp8_synthetic (12:56)", 1.0),
        ("fp8_folder (12:56)", 1.0),
    ]
    proc = subprocess.run(script + [str(b), "--out", str(out), "--bars", "synthetic"], capture_output=True, text=True)
    assert proc.returncode != 0 and "b.json: no successful row of the baseline variant 'synthetic'" in proc.stderr
