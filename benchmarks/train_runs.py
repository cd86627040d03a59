"""One `torchrun ... train.py` run for a benchmark script, in a throwaway run and checkpoint folder, with
its metrics read back (shared by throughput.py, loss_curves.py and checkpoint_stall.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class TrainRunFailed(RuntimeError):
    """The run exited with an error or ran past its time limit; the message ends with its output."""


def run_train(
    config: str, nproc: int, overrides: list[str], timeout: float | None = None, gpus: str | None = None
) -> tuple[list[dict], str]:
    """Train `config` with `overrides` (validation and the final save off unless they turn them on) on
    `nproc` processes, optionally on the GPUs `gpus` only; return the metrics.jsonl rows and the output."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            str(REPO / "train.py"),
            "--config-name",
            config,
            "training.val_every_n_steps=0",
            "training.val_at_end=false",
            "checkpoint.save_final=false",
            "logger.progress_bar=never",
            f"hydra.run.dir={tmp}/run",
            f"checkpoint.path={tmp}/ckpt",
            *overrides,
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _, stderr = _stop(proc)
            raise TrainRunFailed(f"timed out after {timeout:.0f} s:\n{stderr[-2000:]}") from None
        output = stdout + stderr
        if proc.returncode != 0:
            raise TrainRunFailed(f"{' '.join(cmd)} failed:\n{rank_error(output)}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, output


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> tuple[str, str]:
    """End a torchrun past its time limit, and its ranks: SIGTERM, which torchrun passes on to the ranks it started
    (they run in sessions of their own, so killing torchrun alone would leave them holding the GPUs for the next
    run); SIGKILL after `grace` seconds. Returns what it wrote."""
    proc.terminate()
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


# torchrun's own report of a failed rank (its logger's name, and the exception it raises after the ranks end).
LAUNCHER_LINES = (
    "torch/distributed/elastic",
    "torch.distributed.elastic",
    "torch/distributed/run.py",
    "ChildFailedError",
)


def rank_error(output: str, lines: int = 40) -> str:
    """The end of what the ranks wrote before torchrun's report of their failure (which only says that a rank
    failed, and where its error file would be): the failing rank's own error is its last lines."""
    text = output.splitlines()
    first = next((i for i, line in enumerate(text) if any(mark in line for mark in LAUNCHER_LINES)), len(text))
    if first > 0 and text[first - 1].startswith("Traceback"):  # torchrun's own traceback starts the report
        first -= 1
    ranks = [line for line in text[:first] if line.strip()] or text
    return "\n".join(ranks[-lines:])


# A line that states an error: an exception's "SomeError: ..." or a logger's ERROR line (the run's own "data error").
ERROR_LINE = re.compile(r"(\w*(Error|Exception)\b(.*:|\s*$)|\]\[ERROR\]|\bERROR\b)")


RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


def error_headline(error: str) -> str:
    """The line of a failed run's output that says what went wrong: the last one naming an error, not whatever
    a library printed after it (a warning at exit), else the last line; without torchrun's "[rankN]:" prefix."""
    text = [line for line in error.splitlines() if line.strip()] or [""]
    line = next((line for line in reversed(text) if ERROR_LINE.search(line)), text[-1])
    return RANK_PREFIX.sub("", line)
