"""Probe (kept as run): where the training loop's GPU JPEG decode thread spends a 256-image batch beside a busy
GPU, and which of the decoder's CUDA calls and kernels wait. Run from the repo root on a GPU machine:
    OUT=/tmp/out python benchmarks/results/2026-12-02-jpeg-profile-h200/loop_profile.py
Prints timings per variant and a summary of a torch.profiler (CUPTI) trace; writes the traces (gzip) to $OUT."""

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
import collections
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
import numpy as np
import torch

import recipes.vit.crop_resize as C
import recipes.vit.jpeg as J
from benchmarks.jpeg_decoders import busy_step, crops, generated_jpegs, pil_pixels
from core.data import loading
from recipes.vit.config import ImageDataConfig
from recipes.vit.data import Transform, decode_batch

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
T = collections.defaultdict(float)


def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[name] += time.perf_counter() - t

    return g


class Proxy:
    def __init__(self, d):
        self.d = d

    def decode(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.d.decode(*a, **k)
        finally:
            T["nvimgcodec.decode"] += time.perf_counter() - t


orig = J.JpegDecoder._gpu_decoder
J.JpegDecoder._gpu_decoder = staticmethod(lambda *a: (lambda r: (Proxy(r[0]), r[1]))(orig(*a)))
J.JpegDecoder.decode = timed("JpegDecoder.decode", J.JpegDecoder.decode)
C.crop_resize_normalize = timed("crop", C.crop_resize_normalize)

with tempfile.TemporaryDirectory() as tmp:
    files = generated_jpegs(1536, Path(tmp))
boxes = crops(files)
B = 256
host = []
for i in range(0, len(files) - B + 1, B):
    chunk = files[i : i + B]
    host.append(
        {
            "jpeg": torch.from_numpy(np.frombuffer(b"".join(chunk), np.uint8).copy()).pin_memory(),
            "jpeg_sizes": torch.tensor([len(f) for f in chunk]),
            "crop": torch.tensor(boxes[i : i + B]),
            "size": torch.tensor([pil_pixels(f).shape[1:] for f in chunk]),
            "path": [f"image{i + j}" for j in range(B)],
            "label": torch.zeros(B, dtype=torch.long),
        }
    )
transform = Transform(ImageDataConfig(), 224, train=True)
dev = torch.device("cuda")
print("JPEG bytes per batch (MB):", round(host[0]["jpeg"].numel() / 1e6, 1), flush=True)


def report(tag, n, wall):
    print(f"{tag}: {1000 * wall / n:.1f} ms/batch wall;", ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in T.items()), flush=True)
    T.clear()


def run(tag, step, n=30, threads=1, priority=0, mode="free"):
    real_stream = torch.cuda.Stream
    if priority:
        torch.cuda.Stream = lambda *a, **k: real_stream(*a, priority=priority, **k)
    try:
        src = (host[i % len(host)] for i in range(n))
        torch.cuda.synchronize()
        T.clear()
        t = time.perf_counter()
        events = []
        for moved in loading.prefetch_to_device(src, dev, n, lambda b, d: decode_batch(b, transform, d), threads=threads):
            if step is not None:
                step()
            if mode == "sync":
                torch.cuda.current_stream().synchronize()
            elif mode == "lag2":
                e = torch.cuda.Event()
                e.record()
                events.append(e)
                if len(events) > 2:
                    events.pop(0).synchronize()
        torch.cuda.synchronize()
        report(tag, n, time.perf_counter() - t)
    finally:
        torch.cuda.Stream = real_stream


def summarize(path):
    events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    by_stream = collections.defaultdict(list)
    for k in kernels:
        by_stream[k["args"].get("stream")].append(k)
    print("  kernels by stream: stream, count, busy ms, launch->start delay ms (median, max); top names")
    for stream, ks in sorted(by_stream.items(), key=lambda x: -len(x[1])):
        delays = [k["ts"] - launches[k["args"]["correlation"]]["ts"] for k in ks if k["args"].get("correlation") in launches]
        names = collections.Counter()
        durs = collections.defaultdict(float)
        for k in ks:
            names[k["name"][:70]] += 1
            durs[k["name"][:70]] += k["dur"]
        top = "; ".join(f"{n} x{c} {durs[n] / 1000:.1f}ms" for n, c in names.most_common(4))
        d = f"{statistics.median(delays) / 1000:.2f}, {max(delays) / 1000:.2f}" if delays else "-"
        print(f"   {stream}: {len(ks)}, {sum(k['dur'] for k in ks) / 1000:.1f}, ({d}); {top}")
    print("  CUDA API by thread: tid, name, count, total ms, max ms (top 6 per thread)")
    by_tid = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in runtime:
        by_tid[e.get("tid")][e["name"]].append(e["dur"])
    for tid, calls in by_tid.items():
        for name, durs in sorted(calls.items(), key=lambda x: -sum(x[1]))[:6]:
            print(f"   {tid}: {name} x{len(durs)} {sum(durs) / 1000:.1f} {max(durs) / 1000:.2f}")
    for cat in ("gpu_memcpy", "gpu_memset"):
        xs = [e for e in events if e.get("cat") == cat]
        if xs:
            print(f"  {cat}: {len(xs)}, {sum(e['dur'] for e in xs) / 1000:.1f} ms")


for _ in range(3):
    decode_batch(host[0], transform, dev)
torch.cuda.synchronize()
T.clear()
t = time.perf_counter()
for i in range(12):
    decode_batch(host[i % len(host)], transform, dev)
torch.cuda.synchronize()
report("main thread, no step", 12, time.perf_counter() - t)
step = busy_step("vit")
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(12):
    step()
torch.cuda.synchronize()
print(f"vit stand-in step alone: {1000 * (time.perf_counter() - t) / 12:.1f} ms", flush=True)
run("prefetch, no step", None)
run("prefetch, vit step, host free", step)
run("prefetch, vit step, host synchronizing each step", step, mode="sync")
run("prefetch, vit step, side streams high priority", step, priority=-1)
run("prefetch, vit step, 2 threads", step, threads=2)
run("prefetch, vit step, host free (again)", step)
for tag, kw in (("free", {}), ("priority", {"priority": -1})):
    path = OUT / f"trace_{tag}.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(f"profiled: {tag}", step, n=12, **kw)
    prof.export_chrome_trace(str(path))
    print(f"trace {tag}:", flush=True)
    summarize(path)
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    path.unlink()
