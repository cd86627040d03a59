"""Peak memory of planning ESM-2 packs (recipes/esm2/packing.py:PackedSequences), per sequence, for N sequences;
for this checkout and, optionally, others given by path (e.g. a `git worktree` of an earlier commit), in one
invocation, with a check that every checkout plans the same packs.

    python benchmarks/esm2_plan_memory.py --sequences 2000000 20000000 --other /tmp/old-checkout

For each N a preprocessed store is written once (offsets of protein-like lengths: log-normal, median 284
residues, 99th percentile about 1,400; residues.bin a sparse file, since planning reads only the offsets), then
each checkout plans its packs (esm2_650m's shape: rows of 8,192 tokens, sequences cropped to 1,024, at most 64 a
row) in a fresh subprocess that has opened the store, made the indices and read the offsets in first. Measured
there: the growth of peak resident memory while planning (VmHWM reset through /proc/self/clear_refs), or with
--method tracemalloc the peak of Python's and NumPy's traced allocations (slower: every int is traced). Printed:
one JSON line per (checkout, N) and a table; packs equal means the same sequence order and pack boundaries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# Runs in the checkout under test (its own recipes/esm2), so it uses only what every version there has.
CHILD = r"""
import gc, hashlib, json, sys, time, tracemalloc
import numpy as np
from recipes.esm2.masking import Masking
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import read_store

folder, method, budget, max_length, max_sequences = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

store = read_store(folder)
indices = np.arange(len(store), dtype=np.int64)
int(np.asarray(store.offsets).sum())  # the store's offsets paged in: the store's memory, not the plan's
gc.collect()
if method == "tracemalloc":
    tracemalloc.start()
else:
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
start = time.perf_counter()
packs = PackedSequences(store, indices, budget, max_length, max_sequences, Masking(), seed=0, shuffle_seed=1234)
seconds = time.perf_counter() - start
peak = tracemalloc.get_traced_memory()[1] if method == "tracemalloc" else status("VmHWM") - before
digest = hashlib.sha256(np.ascontiguousarray(packs.order)).hexdigest()[:16] + ":" + \
    hashlib.sha256(np.ascontiguousarray(packs.starts)).hexdigest()[:16]
print(json.dumps({"sequences": len(store), "peak_bytes": peak, "bytes_per_sequence": round(peak / len(store), 1),
                  "seconds": round(seconds, 2), "packs": len(packs), "real_tokens": packs.real_tokens,
                  "packs_sha256": digest}))
"""


def write_synthetic_store(folder: Path, sequences: int, seed: int = 0) -> None:
    """A store of `sequences` protein-like lengths as recipes.esm2.preprocess writes it (format version 1), with a
    sparse residues.bin of the right size."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(284), 0.69, sequences), 1, 35_000).astype(np.int64)
    offsets = np.zeros(sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    del lengths
    folder.mkdir(parents=True)
    np.save(folder / "offsets.npy", offsets, allow_pickle=False)
    with open(folder / "residues.bin", "wb") as f:
        f.truncate(int(offsets[-1]))
    index = {
        "version": 1,
        "sequences": sequences,
        "residues": int(offsets[-1]),
        "offsets_sha256": hashlib.sha256(offsets).hexdigest(),
        "source": "synthetic",
    }
    (folder / "index.json").write_text(json.dumps(index))


def describe(checkout: Path) -> str:
    result = subprocess.run(
        ["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return result.stdout.strip() or str(checkout)


def measure(checkout: Path, store: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(store),
            args.method,
            str(args.budget),
            str(args.max_length),
            str(args.max_sequences),
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"error: {checkout}: the probe failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[2_000_000])
    parser.add_argument("--other", type=Path, nargs="*", default=[], help="other checkouts to measure the same way")
    parser.add_argument("--method", choices=("rss", "tracemalloc"), default="rss")
    parser.add_argument("--budget", type=int, default=8192, help="tokens per pack (data.tokens_per_pack)")
    parser.add_argument("--max-length", type=int, default=1024, help="model.max_seq_length")
    parser.add_argument("--max-sequences", type=int, default=64, help="data.max_sequences_per_pack")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the synthetic stores go (default: a temp dir)"
    )
    args = parser.parse_args()
    checkouts = [REPO, *(p.resolve() for p in args.other)]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="esm2-plan-memory-") as work:
        for n in args.sequences:
            store = Path(work) / f"store_{n}"
            write_synthetic_store(store, n)
            for checkout in checkouts:
                row = {
                    "checkout": describe(checkout),
                    "path": str(checkout),
                    "method": args.method,
                    **measure(checkout, store, args),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\n{'checkout':<28} {'sequences':>11} {'bytes/seq':>10} {'peak MB':>9} {'s':>7} {'packs':>9}  same packs")
    for row in rows:
        first = next(r for r in rows if r["sequences"] == row["sequences"])
        same = "yes" if row["packs_sha256"] == first["packs_sha256"] else "NO"
        print(
            f"{row['checkout'][:28]:<28} {row['sequences']:>11,} {row['bytes_per_sequence']:>10} "
            f"{row['peak_bytes'] / 1e6:>9.1f} {row['seconds']:>7} {row['packs']:>9,}  {same}"
        )


if __name__ == "__main__":
    main()
