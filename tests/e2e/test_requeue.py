"""A time-limited cluster job: hydra-submitit-launcher's local executor runs the job as SLURM would (a time
limit, SIGUSR2 30 s before it, requeue by submitit), so the whole life of a job that outlives its limit runs
here: it saves on the warning, is requeued, resumes and finishes with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO

# About 40 s of training on one CPU thread: longer than the 30 s before the first warning, so the job is stopped
# at least once, even on a faster machine; a slower one is requeued more often (up to max_num_timeout).
RUN = [
    "training.steps=500",
    "training.log_every_n_steps=20",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "data.num_workers=0",
    "logger.progress_bar=never",
]


def _train(tmp_path: Path, *args: str, multirun: bool = False) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the job and the reference side by side on 2 cores
    log = open(tmp_path / f"{len(list(tmp_path.iterdir()))}.log", "w")
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            *(["-m"] if multirun else []),
            "--config-name",
            "vit_sanity",
            *RUN,
            *args,
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    assert len(train) == len({r["step"] for r in train}), "a step logged twice"
    return {r["step"]: r["loss"] for r in train}


@pytest.mark.slow
def test_a_time_limited_submitit_job_saves_on_the_warning_is_requeued_and_finishes(tmp_path):
    sweep = tmp_path / "sweep"
    job = _train(
        tmp_path,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=1",
        f"hydra.sweep.dir={sweep}",
        "+hydra.launcher.max_num_timeout=10",
        multirun=True,
    )
    reference = _train(tmp_path, "hydra.run.dir=ref", "checkpoint.path=ref_ckpt")
    assert reference.wait(timeout=400) == 0, (tmp_path / "1.log").read_text()[-3000:]
    assert job.wait(timeout=400) == 0, (tmp_path / "0.log").read_text()[-3000:]

    job_log = (sweep / "0" / "train.log").read_text()
    assert "stopping after step" in job_log and "on SIGUSR2; checkpoint saved" in job_log
    assert "Requeued job" in job_log  # submitit's own log line, in the job's train.log
    invocations = job_log.count("global batch 64")
    assert invocations >= 2, job_log[-3000:]
    losses = _losses(sweep / "0" / "metrics.jsonl")
    assert sorted(losses) == list(range(20, 501, 20))
    assert losses == _losses(tmp_path / "ref" / "metrics.jsonl")  # bit for bit: the stops changed nothing
    (checkpoints,) = (sweep / "checkpoints").iterdir()  # the job's own folder
    steps = [int(p.name[len("step_") :]) for p in checkpoints.glob("step_*") if p.name[len("step_") :].isdigit()]
    assert max(steps) == 500  # by number, not by name: "step_92" sorts after "step_500"
