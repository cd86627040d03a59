"""Training crops decoded where the model trains by an NVIDIA DALI pipeline (data.decode_on=device
data.device_decoder=dali).

One pipeline run per micro-batch does, in DALI's own threads and CUDA stream, what recipes/vit/jpeg.py and
crop_resize.py do file by file from Python: decode each file's crop window (the GPU's hardware JPEG engines where it
has them, through nvImageCodec, shared with nvJPEG's CUDA decoder; libjpeg-turbo on a CPU), resize it to the
model's size with antialiasing, flip and normalize it. The crops and flips are the ones the loader workers drew,
so the images follow the PIL path's up to the decoders' and resizers' rounding and, at colour edges, the hardware
decoder's simpler chroma upsampling (a few percent of the range at most). docs/performance.md compares it with the
nvImageCodec path.

Validation batches (their resize-then-centre-crop geometry) go the nvImageCodec path, and so does any training
batch with a file that path would treat specially: no end-of-image marker (a GPU decoder fills the missing rows
in silence), or a file DALI refuses; that path decodes it on the CPU or stops the run naming the file.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

CPU_THREADS = 4  # the pipeline's host threads: file parsing and the CPU side of decoding


def dali_modules():
    """DALI's fn, pipeline_def and types; a missing DALI is named with what to install."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError as e:
        raise ImportError(
            "data.device_decoder=dali decodes with NVIDIA DALI: pip install nvidia-dali-cuda130 (CUDA 12: "
            f"nvidia-dali-cuda120), or use data.device_decoder=auto ({e})"
        ) from None
    return fn, pipeline_def, types


class DaliCrops:
    """A DALI pipeline for micro-batches of up to `batch_size` files on `device`: JPEG bytes, crop windows and flips
    in, normalized float [N, 3, S, S] images out."""

    def __init__(self, device: torch.device, batch_size: int, size: int, mean: Sequence[float], std: Sequence[float]):
        fn, pipeline_def, types = dali_modules()
        self.device, on_gpu = device, device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None

        @pipeline_def(batch_size=batch_size, num_threads=CPU_THREADS, device_id=index, prefetch_queue_depth=1)
        def crops():
            files = fn.external_source(name="files", dtype=types.UINT8)
            windows = fn.external_source(name="windows", dtype=types.INT32)  # x, y, width, height
            flips = fn.external_source(name="flips", dtype=types.INT32)
            images = fn.decoders.image_slice(
                files,
                fn.slice(windows, 0, 2, axes=[0]),
                fn.slice(windows, 2, 2, axes=[0]),
                device="mixed" if on_gpu else "cpu",
                output_type=types.RGB,
                adjust_orientation=False,  # the pixels as stored: the crops were drawn on the header's size
                # The decoders' own chroma upsampling: libjpeg-turbo's (PIL's) "fancy" one moves the decode off
                # the hardware engines and costs most of the speed (docs/performance.md); colour edges then differ
                # from PIL's by up to a few percent of the range (tests/gpu/test_jpeg_decoding.py).
                jpeg_fancy_upsampling=False,
                normalized_anchor=False,
                normalized_shape=False,
            )
            images = fn.resize(images, size=[size, size], antialias=True, interp_type=types.INTERP_LINEAR)
            return fn.crop_mirror_normalize(
                images,
                mirror=flips,
                dtype=types.FLOAT,
                output_layout="CHW",
                mean=[255 * m for m in mean],
                std=[255 * s for s in std],
            )

        self.pipeline = crops()
        self.pipeline.build()

    def __call__(self, files: Sequence[np.ndarray], crops: Sequence[Sequence[int]]) -> torch.Tensor:
        """`crops`: [top, left, height, width, flip] per file (Transform.draw). On CUDA, ordered on the current
        stream."""
        windows = np.array([[left, top, width, height] for top, left, height, width, _ in crops], dtype=np.int32)
        self.pipeline.feed_input("files", list(files))
        self.pipeline.feed_input("windows", windows)
        self.pipeline.feed_input("flips", np.array([crop[4] for crop in crops], dtype=np.int32))
        (out,) = self.pipeline.run()
        dense = out.as_tensor()
        if self.device.type != "cuda":
            return torch.from_numpy(np.array(dense))
        from nvidia.dali.plugin.pytorch import feed_ndarray

        pixels = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
        feed_ndarray(dense, pixels, cuda_stream=torch.cuda.current_stream(self.device))
        return pixels


_per_thread = threading.local()


def dali_crops(
    files: Sequence[np.ndarray],
    crops: Sequence[Sequence[int]],
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device,
) -> Optional[torch.Tensor]:
    """The training crops of `files` as normalized floats on `device`, or None when the batch is for the nvImageCodec
    path instead (validation crops, a file without its end-of-image marker, a file DALI refuses). One pipeline per
    (device, batch size, image size) and thread, built at its first batch."""
    from recipes.vit.jpeg import ends_whole

    if any(crop[2] < 0 for crop in crops) or not all(ends_whole(data) for data in files):
        return None
    pipelines = _per_thread.__dict__.setdefault("pipelines", {})
    key = (str(device), len(files), size, tuple(mean), tuple(std))
    if key not in pipelines:
        pipelines[key] = DaliCrops(device, len(files), size, mean, std)
    try:
        return pipelines[key](files, crops)
    except RuntimeError as e:  # a file DALI cannot decode or crop; the pipeline is rebuilt for the next batch
        del pipelines[key]
        log.debug("DALI refused a batch, decoded by nvImageCodec instead: %s", e)
        return None
