"""What do per-file checksums cost? (core/checkpointing/storage.py)

    python benchmarks/checkpoint_checksums.py <step dir> [--repeats 2] [--scratch /tmp/ckpt_bench]

On a real checkpoint (e.g. gpt_1b's, written by train.py), in one process:
  * writing: its tensors saved by DCP's plain FileSystemWriter and by our ChecksummingWriter (which
    computes a CRC-32 of every byte as it is written), alternately, `--repeats` times each;
  * loading: the check of every file against its recorded CRC-32 that precedes a resume or init_from,
    with 1 thread and with the 8 the loader uses (one rank; with N ranks each reads 1/N of the files).
Prints seconds and GB/s and writes JSON to benchmarks/results/. The page cache makes reads fast after the
first: the numbers are for files just written, as on a resume right after a save.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.checkpointing.layout import checksum_errors, verify  # noqa: E402
from core.checkpointing.storage import ChecksummingWriter, SafeLoadPlanner, SafeReader  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def load_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    metadata = verify(step_dir)
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=SafeReader(str(step_dir)), planner=SafeLoadPlanner(), no_dist=True)
    return state


def timed_save(state: dict, target: Path, writer_class, threads: int) -> float:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer_class(str(target), thread_count=threads), no_dist=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/checkpoint_checksums_bench"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4], help="DCP writer threads (files per rank)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    size = sum(p.stat().st_size for p in args.step_dir.iterdir() if p.is_file())
    gb = size / 1e9
    verify_s = {}
    for threads in (1, 8):
        start = time.perf_counter()
        errors = checksum_errors(args.step_dir, threads=threads)
        verify_s[threads] = time.perf_counter() - start
        assert not errors, errors
        print(
            f"verify {gb:.2f} GB ({len(list(args.step_dir.glob('*.distcp')))} shard files) with {threads} "
            f"thread(s): {verify_s[threads]:.2f} s ({gb / verify_s[threads]:.2f} GB/s)"
        )
    state = load_tensors(args.step_dir)
    tensor_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    saves: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for threads in args.threads:
            for name, writer in (("plain", dcp.FileSystemWriter), ("checksummed", ChecksummingWriter)):
                seconds = timed_save(state, args.scratch, writer, threads)  # one folder: one checkpoint's space
                saves.setdefault(f"{name}, {threads} thread(s)", []).append(seconds)
                print(
                    f"save {tensor_gb:.2f} GB, {name} writer, {threads} thread(s): {seconds:.2f} s "
                    f"({tensor_gb / seconds:.2f} GB/s)"
                )
    if args.threads:  # verification of the multi-file layout the last thread count writes
        timed_save(state, args.scratch, ChecksummingWriter, args.threads[-1])
        from core.checkpointing.layout import write_marker

        write_marker(args.scratch, {"step": 0})
        start = time.perf_counter()
        assert not checksum_errors(args.scratch, threads=8)
        verify_s[f"8, {args.threads[-1]} files"] = time.perf_counter() - start
        print(f"verify with 8 threads, {args.threads[-1]} files: {verify_s[f'8, {args.threads[-1]} files']:.2f} s")
    shutil.rmtree(args.scratch, ignore_errors=True)
    best = {name: min(times) for name, times in saves.items()}
    for threads in args.threads:
        plain, summed = best[f"plain, {threads} thread(s)"], best[f"checksummed, {threads} thread(s)"]
        print(
            f"{threads} writer thread(s): checksums while writing {100 * (summed / plain - 1):+.1f}% save time "
            f"(best of {args.repeats}: {plain:.2f} -> {summed:.2f} s)"
        )
    overhead = {t: best[f"checksummed, {t} thread(s)"] / best[f"plain, {t} thread(s)"] - 1 for t in args.threads}
    out = REPO / "benchmarks" / "results" / f"checkpoint_checksums_{datetime.datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "step_dir": str(args.step_dir),
                "checkpoint_gb": gb,
                "tensor_gb": tensor_gb,
                "verify_s": verify_s,
                "save_s": saves,
                "save_overhead": overhead,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
