"""train.py end to end, as users run it: 2 gloo processes (ranks as torchrun starts them), plain python, Hydra
multirun under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO, read_records, run_python_ranks, torchrun

QUICK = [
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "data.num_workers=0",
    "logger.progress_bar=never",
]


def run(cmd: list[str], cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def records(run_dir: Path) -> list[dict]:
    return read_records(run_dir)


@pytest.mark.slow
def test_vit_sanity_on_two_processes_learns(tmp_path):
    # The ranks forked from the test fork server, as torchrun starts them (torchrun itself: the multirun below,
    # tests/e2e/test_checkpoints.py and test_failing_jobs.py).
    proc = run_python_ranks(
        2,
        REPO / "train.py",
        "--config-name",
        "vit_sanity",
        "training.steps=150",
        "training.val_every_n_steps=75",
        "logger.progress_bar=never",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    # One run directory for both ranks, with Hydra's files written once (by rank 0).
    (run_dir,) = [p for p in (tmp_path / "outputs" / "vit_sanity").iterdir() if p.name != "checkpoints"]
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "resolved_config.yaml").exists()
    assert (proc.stdout + proc.stderr).count("recipe vit | 2 ranks") == 1
    rows = records(run_dir)
    train = [r for r in rows if "split" not in r]
    val = [r for r in rows if r.get("split") == "val"]
    assert [r["step"] for r in val] == [75, 150]
    assert train[-1]["loss"] < 0.75 * train[0]["loss"]  # loss falls
    assert val[-1]["loss"] < val[0]["loss"]
    assert val[-1]["top1"] > 0.3  # 10 classes: chance is 0.1
    assert all(k in train[0] for k in ("lr", "grad_norm", "step_time", "samples_per_sec_per_gpu", "peak_mem_gib"))
    # The default checkpoint.path does not depend on the run: the same command again resumes from it.
    assert (tmp_path / "outputs" / "vit_sanity" / "checkpoints" / "step_150" / "COMPLETE").exists()


@pytest.mark.slow
def test_plain_python_single_process_with_wandb_offline(tmp_path):
    run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--config-name",
            "vit_sanity",
            "logger=wandb",
            "training.steps=2",
            f"hydra.run.dir={tmp_path}/run",
            *QUICK,
        ],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline"},
    )
    rows = [(r["step"], r.get("split")) for r in records(tmp_path / "run")]
    assert rows == [(1, None), (2, None), (2, "val"), (2, "checkpoint")]  # two steps, validation, the save
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_multirun_sweep_on_two_processes(tmp_path):
    run(
        torchrun(
            2,
            "train.py",
            "-m",
            "--config-name",
            "vit_sanity",
            "optim.lr=1e-3,3e-4",
            "training.steps=3",
            "training.limit_val_batches=1",
            *QUICK,
        ),
        cwd=tmp_path,
    )
    (sweep,) = list((tmp_path / "multirun" / "vit_sanity").iterdir())
    for job, lr in (("0", "0.001"), ("1", "0.0003")):  # checkpoints by configuration, not by job number
        assert (sweep / "checkpoints" / f"optim.lr={lr}" / "step_3" / "COMPLETE").exists()
        assert len([r for r in records(sweep / job) if "split" not in r]) == 3
        assert f"lr: {float(lr)}" in (sweep / job / "resolved_config.yaml").read_text()
