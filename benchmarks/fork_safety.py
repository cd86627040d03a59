"""Run a 2-rank `gpt_sanity` with validation N times in a row and report each run's time, or the run that
hung. Loader workers forked while gloo's threads release tensors can deadlock on CPython before 3.11.10
(python/cpython#112275; docs/data.md); this is the evidence that runs no longer do.

    python benchmarks/fork_safety.py --runs 20                      # this checkout, this Python
    python benchmarks/fork_safety.py --runs 20 --repo /tmp/old      # another checkout, for comparison

A run that passes --timeout seconds counts as hung: its whole process group (torchrun, ranks, loader
workers) is killed and the next run starts. Exit code 1 if any run hung or failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Validation in the middle of training (step 20) and at the end, loader workers on: the moments the old code
# forked its validation workers while FSDP2's asynchronous all-gathers were in flight.
OVERRIDES = [
    "training.steps=40",
    "training.val_every_n_steps=20",
    "training.log_every_n_steps=10",
    "logger.progress_bar=never",
    "data.num_workers=2",
]


def one_run(repo: Path, python: str, timeout: float) -> tuple[str, float]:
    """('ok' | 'hung' | 'failed: <last line>', seconds)."""
    with tempfile.TemporaryDirectory(prefix="fork-safety-") as tmp:
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            str(repo / "train.py"),
            "--config-name",
            "gpt_sanity",
            *OVERRIDES,
            f"data.cache_dir={tmp}/cache",
            f"hydra.run.dir={tmp}/run",
            f"checkpoint.path={tmp}/ckpt",
        ]
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun, both ranks and every loader worker
            proc.communicate()
            return "hung", time.perf_counter() - start
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            lines = [line for line in output.splitlines() if line.strip()]
            return f"failed (exit {proc.returncode}): {lines[-1] if lines else ''}", seconds
        if "val/" not in output and "| val " not in output and "perplexity" not in output:
            return "failed: no validation in the output", seconds
        return "ok", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600, help="seconds after which a run counts as hung")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to run (default: this one)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (with torch) to run it with")
    args = parser.parse_args()
    version = subprocess.run(
        [args.python, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", str(args.repo), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {args.runs} runs of 2-rank gpt_sanity ({' '.join(OVERRIDES)}) | checkout {args.repo} at {commit} | "
        f"Python, torch {version} | {platform.node()}, {os.cpu_count()} cores | "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        flush=True,
    )
    outcomes = []
    for i in range(1, args.runs + 1):
        outcome, seconds = one_run(args.repo.resolve(), args.python, args.timeout)
        outcomes.append(outcome)
        print(f"run {i:2d}: {outcome} in {seconds:.1f} s", flush=True)
    good = outcomes.count("ok")
    print(
        f"# {good} of {args.runs} ran to the end; {outcomes.count('hung')} hung; "
        f"{args.runs - good - outcomes.count('hung')} failed | {time.strftime('%H:%M:%S %Z')}",
        flush=True,
    )
    sys.exit(0 if good == args.runs else 1)


if __name__ == "__main__":
    main()
