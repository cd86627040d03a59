import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
import collections, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, ".")
import numpy as np
import torch
import recipes.vit.jpeg as J
import recipes.vit.crop_resize as C
from core.data import loading
from recipes.vit.config import ImageDataConfig
from recipes.vit.data import Transform, decode_batch
from benchmarks.jpeg_decoders import generated_jpegs, crops, pil_pixels, busy_step

T = collections.defaultdict(float)


def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[name] += time.perf_counter() - t
        return r

    return g


class Proxy:
    def __init__(self, d):
        self.d = d

    def decode(self, *a, **k):
        t = time.perf_counter()
        r = self.d.decode(*a, **k)
        T["gpu.decode"] += time.perf_counter() - t
        return r


orig = J.JpegDecoder._gpu_decoder
J.JpegDecoder._gpu_decoder = staticmethod(lambda *a: (lambda r: (Proxy(r[0]), r[1]))(orig(*a)))
J.JpegDecoder.decode = timed("JpegDecoder.decode", J.JpegDecoder.decode)
torch.from_dlpack = timed("from_dlpack", torch.from_dlpack)
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


def report(tag, n, wall):
    print(
        tag,
        f"{1000 * wall / n:.1f} ms/batch wall;",
        ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in T.items()),
        flush=True,
    )
    T.clear()


for _ in range(3):
    decode_batch(host[0], transform, dev)
torch.cuda.synchronize()
T.clear()
t = time.perf_counter()
for i in range(12):
    decode_batch(host[i % len(host)], transform, dev)
torch.cuda.synchronize()
report("main thread, no step:", 12, time.perf_counter() - t)
for kind, mode in (("vit", "free"), ("vit", "sync"), ("vit", "lag2"), ("sleep", "free")):
    step = busy_step(kind)
    src = (host[i % len(host)] for i in range(30))
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    events = []
    for moved in loading.prefetch_to_device(src, dev, 30, lambda b, d: decode_batch(b, transform, d)):
        step()
        if mode == "sync":
            torch.cuda.current_stream().synchronize()
        elif mode == "lag2":
            e = torch.cuda.Event()
            e.record()
            events.append(e)
            if len(events) > 2:
                events.pop(0).synchronize()
        n += 1
    torch.cuda.synchronize()
    report(f"prefetch thread, step={kind} {mode}:", n, time.perf_counter() - t)
