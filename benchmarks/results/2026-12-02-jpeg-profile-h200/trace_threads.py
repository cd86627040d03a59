"""Probe (kept as run): per host thread, the CUDA calls of a torch.profiler trace and the long pauses between
them; per stream, kernels and their launch-to-start delays. python trace_threads.py TRACE.json[.gz]"""

import collections
import gzip
import json
import statistics
import sys

path = sys.argv[1]
events = json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]
runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
launches = {e["args"].get("correlation"): e for e in runtime if "args" in e}
kernels = [e for e in events if e.get("cat") == "kernel"]
span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1000
print(f"trace: {span:.0f} ms of kernels")
by_stream = collections.defaultdict(list)
for k in kernels:
    by_stream[k["args"].get("stream")].append(k)
print("kernels by stream: count, busy ms, launch->start delay ms (median, max); top names")
for stream, ks in sorted(by_stream.items(), key=lambda x: -sum(k["dur"] for k in x[1]))[:12]:
    delays = [k["ts"] - launches[k["args"]["correlation"]]["ts"] for k in ks if k["args"].get("correlation") in launches]
    names, durs = collections.Counter(), collections.defaultdict(float)
    for k in ks:
        names[k["name"][:60]] += 1
        durs[k["name"][:60]] += k["dur"]
    top = "; ".join(f"{n} x{c} {durs[n] / 1000:.1f}ms" for n, c in names.most_common(3))
    d = f"{statistics.median(delays) / 1000:.2f}, {max(delays) / 1000:.2f}" if delays else "-"
    print(f"  stream {stream}: {len(ks)}, {sum(k['dur'] for k in ks) / 1000:.1f}, ({d}); {top}")
threads = collections.defaultdict(list)
for e in runtime:
    threads[e.get("tid")].append(e)
print("CUDA calls by thread: calls, ms in calls; top calls; pauses > 2 ms between calls (count, ms, the pairs)")
for tid, calls in sorted(threads.items(), key=lambda x: -len(x[1])):
    per = collections.defaultdict(list)
    for e in calls:
        per[e["name"]].append(e["dur"])
    top = "; ".join(f"{n} x{len(d)} {sum(d) / 1000:.1f}" for n, d in sorted(per.items(), key=lambda x: -sum(x[1]))[:5])
    pauses = collections.defaultdict(list)
    for a, b in zip(calls, calls[1:]):
        gap = b["ts"] - a["ts"] - a["dur"]
        if gap > 2000:
            pauses[(a["name"], b["name"])].append(gap)
    total = sum(sum(g) for g in pauses.values())
    print(f"  thread {tid}: {len(calls)} calls, {sum(e['dur'] for e in calls) / 1000:.1f} ms; {top}")
    for pair, gaps in sorted(pauses.items(), key=lambda x: -sum(x[1]))[:4]:
        print(f"    pause {pair[0]} -> {pair[1]}: x{len(gaps)}, {sum(gaps) / 1000:.1f} ms (max {max(gaps) / 1000:.1f})")
    print(f"    pauses in all: {total / 1000:.1f} ms")
