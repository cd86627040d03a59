"""A failing job ends: an error on any rank ends every rank with a non-zero exit within a bound, the error
on stderr, and no process left behind (ranks, loader workers); ranks stop when their launcher is killed.
torchrun with 2 CPU processes and 2 loader workers each (the setup in which jobs used to hang)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.checkpoint_harness import TINY
from tests.support.helpers import PROCESS_TAG, kill_processes, tagged_processes, torchrun

BOUND_S = 90  # every failing run must have ended by then (each takes ~20 s to start and fail on 2 cores)
WORKERS = ["data.num_workers=2"]


def _start(tmp_path: Path, overrides: list[str], fault: dict, tag: str) -> subprocess.Popen:
    env = {**os.environ, PROCESS_TAG: tag, **fault}
    return subprocess.Popen(
        torchrun(
            2,
            "tests/support/fault_run.py",
            "--config-name",
            "vit_sanity",
            *overrides,
            f"checkpoint.path={tmp_path}/ckpt",
            f"hydra.run.dir={tmp_path}/run",
        ),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _ends_in_bound(proc: subprocess.Popen, tag: str, started: float) -> str:
    try:
        out, _ = proc.communicate(timeout=max(1.0, BOUND_S - (time.time() - started)))
    except subprocess.TimeoutExpired:
        kill_processes(tagged_processes(tag))
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end within {BOUND_S} s:\n{out[-3000:]}")
    deadline = time.time() + 15  # loader workers notice their parent is gone within a few seconds
    while tagged_processes(tag) and time.time() < deadline:
        time.sleep(0.2)
    left = tagged_processes(tag)
    kill_processes(left)
    assert not left, f"processes left running after the job ended: {left}\n{out[-3000:]}"
    return out


def _failing_run(tmp_path: Path, overrides: list[str], fault: dict) -> str:
    tag = uuid.uuid4().hex
    started = time.time()
    proc = _start(tmp_path, overrides, fault, tag)
    out = _ends_in_bound(proc, tag, started)
    assert proc.returncode != 0, out[-3000:]
    print(f"ended in {time.time() - started:.1f} s with exit code {proc.returncode}")
    return out


def _digits_with_bad_images(root: Path) -> Path:
    """Two classes of PNGs, with a file that is no image (left out when the dataset is built) and one whose
    header reads but whose pixels are cut off (found only when a loader worker decodes it)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 4)):
        for label in range(2):
            folder = root / split / str(label)
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (root / "train" / "0" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00not an image" * 20)
    whole = (root / "train" / "1" / "7.png").read_bytes()
    (root / "train" / "1" / "7.png").write_bytes(whole[: len(whole) // 2])
    return root


@pytest.mark.slow
def test_a_corrupt_image_ends_the_job(tmp_path):
    root = _digits_with_bad_images(tmp_path / "images")
    overrides = (
        [o for o in TINY if not o.startswith("data")]
        + WORKERS
        + [f"data.root={root}", "data.num_classes=2", "training.steps=40"]
    )
    out = _failing_run(tmp_path, overrides, {})
    assert "left out 1 of 24 image files that cannot be read" in out and "3.png" in out, out[-3000:]
    assert "cannot decode the image" in out and "7.png" in out, out[-3000:]


@pytest.mark.slow
def test_workers_stop_when_torchrun_is_killed(tmp_path):
    """kill -9 of torchrun alone: its workers (and their loader workers) stop on their own."""
    tag = uuid.uuid4().hex
    proc = _start(tmp_path, TINY + WORKERS + ["training.steps=100000", "checkpoint.save_every_n_steps=0"], {}, tag)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + BOUND_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, "the run did not get going"
        time.sleep(0.1)
    proc.kill()  # torchrun only
    killed = time.time()
    proc.communicate()
    while tagged_processes(tag) and time.time() < killed + 20:
        time.sleep(0.2)
    left = tagged_processes(tag)
    kill_processes(left)
    assert not left, "workers went on training without their launcher"
