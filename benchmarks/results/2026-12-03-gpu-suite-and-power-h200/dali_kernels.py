"""Which GPU kernels the shipped DALI pipeline (recipes/vit/dali_crops.py) runs for one 256-image micro-batch of
training crops, and how long each takes, against the GPU work the PIL path leaves (uint8 crops normalized to
floats). The JPEGs: scripts/make_jpeg_imagefolder.py's; the crops: the recipe's random resized crops and flips.
    python benchmarks/results/2026-12-03-gpu-suite-and-power-h200/dali_kernels.py /tmp/jpegs/train [cuda|cpu]"""

import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from torchvision.transforms import v2

from recipes.vit.dali_crops import DaliCrops
from recipes.vit.data import random_resized_crop_box

BATCH, SIZE, RUNS = 256, 224, 10
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def inputs(root: Path):
    from PIL import Image

    paths = sorted(root.rglob("*.jpg"))[:BATCH]
    files = [np.fromfile(p, dtype=np.uint8) for p in paths]
    g, crops = torch.Generator().manual_seed(0), []
    for p in paths:
        with Image.open(p) as img:
            top, left, h, w = random_resized_crop_box(img.height, img.width, (0.08, 1.0), (3 / 4, 4 / 3), g)
        crops.append([top, left, h, w, int(torch.rand((), generator=g) < 0.5)])
    return files, crops


def kernel_table(prof, runs: int) -> None:
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, us = totals.get(event.name, (0, 0.0))
            totals[event.name] = (count + 1, us + event.device_time)
    print(f"{'kernel / copy':90} {'calls/run':>9} {'us/run':>9}")
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:90]:90} {count / runs:9.1f} {us / runs:9.1f}")
    print(f"{'all':90} {'':9} {sum(us for _, us in totals.values()) / runs:9.1f}")


def main(root: str, device_name: str = "cuda") -> None:
    device = torch.device(device_name)
    files, crops = inputs(Path(root))
    dali = DaliCrops(device, BATCH, SIZE, MEAN, STD)
    for _ in range(5):
        dali(files, crops)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(RUNS):
        dali(files, crops)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"DALI pipeline alone: {(time.perf_counter() - start) / RUNS * 1e3:.2f} ms per {BATCH}-image batch (wall)")
    if device.type != "cuda":
        return
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for _ in range(RUNS):
            dali(files, crops)
        torch.cuda.synchronize()
    print("== DALI, as shipped")
    kernel_table(prof, RUNS)
    uint8 = torch.randint(0, 255, (BATCH, 3, SIZE, SIZE), dtype=torch.uint8, device=device)
    with profile(activities=activities) as prof:
        for _ in range(RUNS):
            v2.functional.normalize(v2.functional.to_dtype(uint8, torch.float32, scale=True), MEAN, STD)
        torch.cuda.synchronize()
    print("== the PIL path's GPU work: uint8 crops to normalized floats (Transform.normalize's ops)")
    kernel_table(prof, RUNS)


if __name__ == "__main__":
    main(*sys.argv[1:])
