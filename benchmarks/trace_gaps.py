"""Where a profiled step's GPU time goes, and where the GPU sits idle, from a `training.profile` trace.

    python benchmarks/trace_gaps.py <run dir>/profile/rank0.trace.json [--top 15] [--min-gap-ms 0.2]

Per ProfilerStep: wall time, GPU busy time (the union of kernels, copies and memsets on all streams),
kernel time by kind (GEMM, attention, normalization, ...), the host calls that block on the GPU, and the
longest idle gaps with the operator whose kernel ended each gap (the host was still launching it).
A ProfilerStep is a span of host time; GPU work is counted where it ran in that span, so when the host
runs a step ahead of the GPU, a span holds parts of two steps (their sum over the spans is exact).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = re.compile(r"cuda(Stream|Device|Event)Synchronize|cudaMemcpy(?!Async)|cudaStreamWaitEvent$")
KINDS = [  # first match wins
    ("gemm", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|ampere_.*gemm", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|attn|dot_do_o|convert_dq|reduce_head", re.I)),
    ("normalization", re.compile(r"norm", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)),
    ("communication", re.compile(r"nccl|onerank", re.I)),
    ("activation", re.compile(r"gelu|gated_act|swiglu|silu|dgated", re.I)),
    ("rope", re.compile(r"rope", re.I)),
    ("cross-entropy", re.compile(r"cross_entropy", re.I)),
    ("copy/cast/fill", re.compile(r"copy|cast|fill|memcpy|memset|transpose|cat", re.I)),
    ("elementwise/other", re.compile(r".")),
]


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union_busy(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered time and the merged intervals, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged), [(s, e) for s, e in merged]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12, help="idle gaps listed per step")
    ap.add_argument("--min-gap-ms", type=float, default=0.2)
    args = ap.parse_args()

    events = [e for e in load(args.trace) if e.get("ph") == "X"]
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")),
        key=lambda e: e["ts"],
    )
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    op_starts = [e["ts"] for e in cpu_ops]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and SYNC_CALLS.search(e["name"])]

    def op_at(tid, ts: float) -> str:
        """The innermost CPU operator on thread `tid` that was running at `ts`."""
        best = None
        for e in reversed(
            cpu_ops[max(0, bisect.bisect_right(op_starts, ts) - 2000) : bisect.bisect_right(op_starts, ts)]
        ):
            if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]:
                if best is None or e["dur"] < best["dur"]:
                    best = e
        return best["name"] if best else "?"

    for step in steps:
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        inside = [k for k in gpu if t0 <= k["ts"] < t1]
        busy, merged = union_busy([(k["ts"], min(k["ts"] + k["dur"], t1)) for k in inside])
        print(
            f"\n{step['name']}: wall {step['dur'] / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
            f"({100 * busy / step['dur']:.0f}%), {len(inside)} GPU activities"
        )
        by_kind: dict[str, float] = defaultdict(float)
        for k in inside:
            by_kind[next(kind for kind, rx in KINDS if rx.search(k["name"]))] += k["dur"]
        total = sum(by_kind.values())
        for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<20} {dur / 1e3:8.1f} ms  {100 * dur / total:5.1f}% of kernel time")
        blocking = [e for e in syncs if t0 <= e["ts"] < t1 and e["dur"] > 50]
        if blocking:
            print("  host calls that waited on the GPU (> 50 us):")
            for e in sorted(blocking, key=lambda e: -e["dur"])[:8]:
                print(f"    {e['name']:<28} {e['dur'] / 1e3:7.2f} ms  in {op_at(e['tid'], e['ts'])}")
        # Gaps: from the end of one busy interval to the start of the next; the kernel that ends the gap
        # tells (through its launch call) which operator the host was in.
        starts = [k["ts"] for k in inside]
        gaps = []
        edges = [(t0, t0)] + merged + [(t1, t1)]
        for (_, prev_end), (next_start, _) in zip(edges, edges[1:]):
            if next_start - prev_end >= args.min_gap_ms * 1e3:
                gaps.append((next_start - prev_end, prev_end, next_start))
        idle = sum(g for g, _, _ in gaps)
        print(f"  idle gaps >= {args.min_gap_ms} ms: {len(gaps)}, {idle / 1e3:.1f} ms in total; the longest:")
        for gap, _, next_start in sorted(gaps, reverse=True)[: args.top]:
            i = bisect.bisect_left(starts, next_start)
            where = "end of step"
            if i < len(inside):
                k = inside[i]
                launch = runtime.get(k.get("args", {}).get("correlation"))
                op = op_at(launch["tid"], launch["ts"]) if launch else "?"
                where = f"before {k['name'][:60]} (launched in {op})"
            print(f"    {gap / 1e3:7.2f} ms at +{(next_start - gap - t0) / 1e3:7.1f} ms  {where}")


if __name__ == "__main__":
    main()
