"""JPEG decoders on one GPU, measured without a model: how fast each decodes a micro-batch, how long it holds
the host, how far its pixels are from PIL's, and how much it slows a busy GPU "step" running beside it on
another stream (the way the training loop overlaps the next micro-batch's decode with the current step).

    python benchmarks/jpeg_decoders.py --images 3072 --batch 256 --out benchmarks/results

Decoders: torchvision's decode_jpeg on CUDA (nvJPEG on the SMs; deprecated since torchvision 0.29) and
nvImageCodec with each backend: hw (the GPU's hardware JPEG engines), gpu (CUDA kernels), hybrid (Huffman
on CPU threads), several joined by '/' in order of preference. "+roi" decodes only the random-resized-crop
window the recipe draws; "+reuse" decodes into the buffers of the batch before last (no allocations);
"+crop" adds the recipe's crop, resize, flip and normalization (one Triton kernel); "loop" is
the training loop's way (a thread decoding ahead: measure_loop).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generated_jpegs(count: int, folder: Path) -> list[bytes]:
    from concurrent.futures import ProcessPoolExecutor

    from scripts.make_jpeg_imagefolder import write_image

    paths = [folder / f"{i:06d}.jpg" for i in range(count)]
    with ProcessPoolExecutor(16) as pool:
        list(pool.map(write_image, [(p, i, 90) for i, p in enumerate(paths)], chunksize=32))
    return [p.read_bytes() for p in paths]


def crops(files: list[bytes], seed: int = 0) -> list[list[int]]:
    """The recipe's training crops (top, left, h, w, flip) for each file, from its JPEG header."""
    import torch
    from PIL import Image

    from recipes.vit.config import ImageDataConfig
    from recipes.vit.data import Transform

    transform = Transform(ImageDataConfig(), 224, train=True)
    out = []
    for i, raw in enumerate(files):
        with Image.open(io.BytesIO(raw)) as img:
            width, height = img.size
        out.append(transform.draw(height, width, torch.Generator().manual_seed(seed * 1_000_003 + i)))
    return out


def torchvision_decoder():
    import torch
    import torchvision

    def decode(batch: list[bytes], boxes, stream):
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in batch]
        return torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device="cuda")

    return decode


def nvimgcodec_decoder(kinds: str, roi: bool, reuse: bool, crop: bool, options: str = "", threads: int = 0):
    """kinds: backends joined by '/', in order of preference (e.g. hw/hybrid); options and threads: the
    Decoder's own (its options string, max_num_cpu_threads)."""
    import torch
    from nvidia import nvimgcodec

    backend = {
        "hw": nvimgcodec.BackendKind.HW_GPU_ONLY,
        "gpu": nvimgcodec.BackendKind.GPU_ONLY,
        "hybrid": nvimgcodec.BackendKind.HYBRID_CPU_GPU,
    }
    decoder = nvimgcodec.Decoder(
        backends=[nvimgcodec.Backend(backend[k]) for k in kinds.split("/")],
        options=options,
        max_num_cpu_threads=threads,
    )
    params = nvimgcodec.DecodeParams(sample_format=nvimgcodec.P_RGB, apply_exif_orientation=False)
    pools, calls = [None] * 3, [0]  # reuse: three batches' output buffers in turn, no allocation once grown

    def decode(batch: list[bytes], boxes, stream):
        streams = [nvimgcodec.CodeStream(b) for b in batch]
        if roi:
            streams = [
                s.get_sub_code_stream(region=nvimgcodec.Region(top, left, top + h, left + w))
                for s, (top, left, h, w, _) in zip(streams, boxes)
            ]
        slot = calls[0] % 3
        calls[0] += 1
        previous = pools[slot] if reuse and pools[slot] is not None and len(pools[slot]) == len(streams) else None
        images = decoder.decode(streams, images=previous, params=params, cuda_stream=stream.cuda_stream)
        pools[slot] = images
        missing = [i for i, image in enumerate(images) if image is None]
        if missing:
            raise RuntimeError(f"{len(missing)} images not decoded (first {missing[0]})")
        tensors = [torch.from_dlpack(image) for image in images]
        return crop_resize(tensors, boxes) if crop else tensors

    return decode


def crop_resize(images, boxes):
    """The recipe's crop, resize, flip and normalization of the batch (recipes/vit/crop_resize.py)."""
    from recipes.vit.config import ImageDataConfig
    from recipes.vit.crop_resize import crop_resize_normalize
    from recipes.vit.data import Transform

    return crop_resize_normalize(images, boxes, Transform(ImageDataConfig(), 224, train=True))


def pil_pixels(raw: bytes):
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as img:
        return np.asarray(img.convert("RGB")).transpose(2, 0, 1)


def busy_step(kind: str = "gemm"):
    """A stand-in for a training step of about 60 ms on an H100: large bf16 GEMMs ("gemm"), ViT-B-sized ones
    (tokens of a 256-image micro-batch x 768 x 3072, "vit"), or one thread spinning on one SM ("sleep": the
    GPU otherwise idle, to tell a decoder's waiting on the device from its competing for SMs)."""
    import torch

    if kind == "sleep":
        torch.cuda._sleep(10_000_000)
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.cuda._sleep(100_000_000)
        torch.cuda.synchronize()
        cycles = int(100_000_000 * 0.06 / (time.perf_counter() - t))
        return lambda: torch.cuda._sleep(cycles)
    m, k, n, repeats = (8192, 8192, 8192, 40) if kind == "gemm" else (256 * 197, 768, 3072, 180)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    def step():
        for _ in range(repeats):
            torch.mm(a, b)

    return step


def measure_loop(files, boxes, batch: int, args) -> dict:
    """The training loop's way: core/data/loading.py's threads decode (recipes/vit/data.py decode_batch) ahead,
    each on its own stream, while the default stream runs the step; seconds per step with and without
    decoding."""
    import numpy as np
    import torch

    from core.data import loading
    from recipes.vit.config import ImageDataConfig
    from recipes.vit.data import Transform, decode_batch

    transform = Transform(ImageDataConfig(), 224, train=True)
    host = []
    for i in range(0, len(files) - batch + 1, batch):
        chunk = files[i : i + batch]
        host.append(
            {
                "jpeg": torch.from_numpy(np.frombuffer(b"".join(chunk), np.uint8).copy()),
                "jpeg_sizes": torch.tensor([len(f) for f in chunk]),
                "crop": torch.tensor(boxes[i : i + batch]),
                "size": torch.tensor([pil_pixels(f).shape[1:] for f in chunk]),
                "path": [f"image{i + j}" for j in range(batch)],
                "label": torch.zeros(batch, dtype=torch.long),
            }
        )
    step, device = busy_step(args.step), torch.device("cuda")
    sink = torch.zeros((), device=device)

    def run(decode: bool, count: int) -> float:
        move = (lambda b, d: decode_batch(b, transform, d, args.backend)) if decode else loading.to_device
        source = (host[i % len(host)] for i in range(count))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for moved in loading.prefetch_to_device(source, device, count, move, threads=args.threads):
            step()
            sink.add_(moved["label"].sum())  # the step reads the batch
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / count

    run(True, 4)
    alone, beside = run(False, args.steps), run(True, args.steps)
    return {
        "decoder": f"loop-{args.backend}",
        "step": args.step,
        "threads": args.threads,
        "step_ms_alone": round(1000 * alone, 1),
        "step_ms_with_decode": round(1000 * beside, 1),
        "step_slowdown": round(beside / alone, 3),
        "img_per_s_with_decode": round(batch / beside),
    }


def measure(name, decode, files, boxes, batch, args) -> dict:
    import numpy as np
    import torch

    stream = torch.cuda.Stream()
    batches = [(files[i : i + batch], boxes[i : i + batch]) for i in range(0, len(files) - batch + 1, batch)]
    with torch.cuda.stream(stream):
        for chunk, box in batches[:2]:  # warm-up: handles, buffers, first allocations
            decode(chunk, box, stream)
    torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        for chunk, box in batches:
            t = time.perf_counter()
            out = decode(chunk, box, stream)
            host += time.perf_counter() - t
    torch.cuda.synchronize()
    alone = len(batches) * batch / (time.perf_counter() - start)
    # Pixels against PIL (full decodes only; a region decode is compared on its window).
    first = decode(files[:16], boxes[:16], torch.cuda.current_stream())
    torch.cuda.synchronize()
    diffs = []
    if "crop" in name:
        first = []  # not comparable with a decode
    for raw, box, image in zip(files[:16], boxes[:16], first):
        ref = pil_pixels(raw).astype(np.int16)
        got = image.cpu().numpy().astype(np.int16)
        if got.shape[-1] == 3 and got.shape[0] != 3:
            got = got.transpose(2, 0, 1)
        if "roi" in name:
            top, left, h, w, _ = box
            ref = ref[:, top : top + h, left : left + w]
        if got.shape != ref.shape:
            diffs.append(f"shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            continue
        diffs.append(np.abs(got - ref))
    shapes_ok = all(not isinstance(d, str) for d in diffs)
    max_diff = max((int(d.max()) for d in diffs), default=None) if shapes_ok else diffs
    mean_diff = float(np.mean([d.mean() for d in diffs])) if shapes_ok and diffs else None
    # Beside a busy step: the step on the default stream, the next batch's decode on a side stream.
    step = busy_step(args.step)
    compute = torch.cuda.default_stream() if args.step_stream == "default" else torch.cuda.Stream()
    with torch.cuda.stream(compute):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        step_alone = (time.perf_counter() - t) / args.steps
        t, host_beside = time.perf_counter(), 0.0
        for i in range(args.steps):
            step()
            with torch.cuda.stream(stream):
                chunk, box = batches[i % len(batches)]
                h = time.perf_counter()
                out = decode(chunk, box, stream)
                host_beside += time.perf_counter() - h
            compute.wait_stream(stream)
        torch.cuda.synchronize()
        step_beside = (time.perf_counter() - t) / args.steps
    del out
    return {
        "decoder": name,
        "img_per_s_alone": round(alone),
        "host_ms_per_batch": round(1000 * host / len(batches), 1),
        "max_abs_diff_vs_pil": max_diff,
        "mean_abs_diff_vs_pil": mean_diff,
        "step_ms_alone": round(1000 * step_alone, 1),
        "step_ms_beside_decode": round(1000 * step_beside, 1),
        "step_slowdown": round(step_beside / step_alone, 3),
        "host_ms_per_batch_beside": round(1000 * host_beside / args.steps, 1),
        "step_stream": args.step_stream,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--step-stream",
        choices=["default", "side"],
        default="default",
        help="the stand-in step on PyTorch's default stream (as the training loop) or on another",
    )
    parser.add_argument(
        "--step", choices=["gemm", "vit", "sleep"], default="gemm", help="the stand-in step (busy_step)"
    )
    parser.add_argument("--backend", default="auto", help="loop: data.device_decoder")
    parser.add_argument("--threads", type=int, default=1, help="loop: data.decode_threads")
    parser.add_argument("--decoder-options", default="", help="nvImageCodec Decoder options, e.g. :num_cuda_streams=1")
    parser.add_argument(
        "--decoder-threads", type=int, default=0, help="nvImageCodec max_num_cpu_threads (0: its default)"
    )
    parser.add_argument(
        "--decoders",
        nargs="+",
        default=[
            "torchvision",
            "nvimgcodec-hw",
            "nvimgcodec-hw+reuse",
            "nvimgcodec-hw+reuse+crop",
            "nvimgcodec-hw/hybrid",
            "nvimgcodec-hybrid",
        ],
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=None,
        help="CUDA_DEVICE_MAX_CONNECTIONS (default: what a run decoding on the GPU sets, recipes/vit/jpeg.py; "
        "0: the driver's default)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return parser


def main() -> None:
    args = _parser().parse_args()
    from core.runtime import request_cuda_connections
    from recipes.vit.jpeg import CUDA_CONNECTIONS

    connections = CUDA_CONNECTIONS if args.connections is None else args.connections
    request_cuda_connections(connections or None)  # before CUDA starts
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        files = generated_jpegs(args.images, Path(tmp))
    boxes = crops(files)
    rows = []
    for name in args.decoders:
        try:
            if name == "loop":
                rows.append(measure_loop(files, boxes, args.batch, args))
                print(json.dumps(rows[-1]), flush=True)
                continue
            if name == "torchvision":
                decode = torchvision_decoder()
            else:
                kinds, *options = name.removeprefix("nvimgcodec-").split("+")
                decode = nvimgcodec_decoder(
                    kinds,
                    "roi" in options,
                    "reuse" in options,
                    "crop" in options,
                    args.decoder_options,
                    args.decoder_threads,
                )
            rows.append(measure(name, decode, files, boxes, args.batch, args))
        except Exception as e:  # one decoder failing (no hardware engine, say) does not end the others
            traceback.print_exc()
            rows.append({"decoder": name, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
    header = [
        "decoder",
        "img_per_s_alone",
        "host_ms_per_batch",
        "host_ms_per_batch_beside",
        "step_slowdown",
        "max_abs_diff_vs_pil",
        "mean_abs_diff_vs_pil",
    ]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row.get(k, "")) for k in header))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    (out / f"jpeg_decoders-{stamp}.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "images": args.images,
                "batch": args.batch,
                "cuda_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "driver default"),
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
