"""JPEG decoding where the model trains (data.decode_on=device), with NVIDIA nvImageCodec.

On a GPU that has hardware JPEG engines (A100, H100, H200 and others: NVJPG) the images are decoded there,
leaving the SMs to the training step; elsewhere by nvJPEG's CUDA decoder with Huffman decoding on CPU threads
("cuda"). On a CPU, by libjpeg-turbo, as PIL decodes in the loader workers. Files a GPU decoder refuses
(the hardware engines take baseline JPEGs only, not progressive ones) or might fill in silence (no
end-of-image marker) are decoded on the CPU instead; a file nothing can decode stops the run, named.
docs/performance.md compares the decoders.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import tempfile
import threading
from typing import Sequence

import numpy as np
import torch

from core.config.errors import DataError

os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "1")  # errors only: a refused file is reported by us, named

log = logging.getLogger(__name__)

BACKENDS = ("auto", "hardware", "cuda")
KEEP_BATCHES = 3  # decoded images kept alive while the kernels that read them may still be queued
# CUDA_DEVICE_MAX_CONNECTIONS for a run that decodes on the GPU (the driver's most; its default is 8). The decoder
# queues its work on streams of its own; where two streams share a hardware queue, the later one's work waits for
# everything queued before it, and the decode waited for the whole training step (docs/performance.md).
CUDA_CONNECTIONS = 32


def nvimgcodec():
    """The nvidia.nvimgcodec module. Its first import prints to the process's stderr which optional codec
    libraries (JPEG 2000, TIFF) it did not find: that goes to this module's debug log instead. Import it first
    from the main thread (build_image_datasets does), while nothing else writes to stderr."""
    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"]
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                from nvidia import nvimgcodec as module
            finally:
                os.dup2(saved, 2)
                captured.seek(0)
                printed = captured.read().decode(errors="replace").strip()
    except ImportError as e:
        raise ImportError(
            "data.decode_on=device decodes with NVIDIA nvImageCodec: pip install "
            "nvidia-nvimgcodec-cu13 nvidia-nvjpeg (CUDA 12: nvidia-nvimgcodec-cu12), or use "
            f"data.decode_on=workers ({e})"
        ) from None
    finally:
        os.close(saved)
    if printed:
        log.debug("nvImageCodec at import: %s", printed)
    return module


def _tiny_jpeg() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 160, 30)).save(out, "JPEG", quality=90)
    return out.getvalue()


class JpegDecoder:
    """Decodes a batch of JPEG files into uint8 [3, H, W] tensors on `device` (RGB, EXIF orientation not
    applied: the pixels PIL's convert("RGB") gives, which the crops were drawn on)."""

    def __init__(self, device: torch.device, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"data.device_decoder={backend!r}: expected one of {', '.join(BACKENDS)}")
        codec = nvimgcodec()
        self.device = device
        self.params = codec.DecodeParams(sample_format=codec.P_RGB, apply_exif_orientation=False)
        self.cpu = codec.Decoder(
            device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[codec.Backend(codec.BackendKind.CPU_ONLY)]
        )
        self.gpu, self.backend = None, "cpu"
        if device.type == "cuda":
            self.gpu, self.backend = self._gpu_decoder(codec, device, backend)
        self.kept: collections.deque = collections.deque(maxlen=KEEP_BATCHES)

    @staticmethod
    def _gpu_decoder(codec, device: torch.device, backend: str):
        index = device.index if device.index is not None else torch.cuda.current_device()
        kinds = {"hardware": codec.BackendKind.HW_GPU_ONLY, "cuda": codec.BackendKind.HYBRID_CPU_GPU}
        for name in ["hardware", "cuda"] if backend == "auto" else [backend]:
            try:
                decoder = codec.Decoder(device_id=index, backends=[codec.Backend(kinds[name])])
                with torch.cuda.device(index):
                    works = decoder.decode([codec.CodeStream(_tiny_jpeg())])[0] is not None
                    torch.cuda.synchronize()
            except RuntimeError:
                works = False
            if works:
                return decoder, name
        raise RuntimeError(
            f"data.device_decoder={backend}: this GPU ({torch.cuda.get_device_name(index)}) cannot "
            "decode JPEGs that way (no hardware JPEG engines?); use data.device_decoder=auto"
        )

    def decode(
        self, files: Sequence[np.ndarray], names: Sequence[str], sizes: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """One uint8 [3, H, W] tensor per file, on the device; on CUDA ordered on the current stream. `sizes`:
        each file's (height, width) as PIL read its header in the loader worker (its decompression-bomb check
        bounds them); a file whose header reads otherwise here is refused before anything is allocated, one
        decoded to another size after."""
        streams = checked_streams(files, names, sizes)
        images: list = [None] * len(streams)
        on_gpu = [i for i, data in enumerate(files) if self.gpu is not None and ends_whole(data)]
        if on_gpu:
            stream = torch.cuda.current_stream(self.device)
            decoded = self.gpu.decode([streams[i] for i in on_gpu], params=self.params, cuda_stream=stream.cuda_stream)
            self.kept.append(decoded)  # their memory must outlive the kernels queued to read it
            for i, image in zip(on_gpu, decoded):
                images[i] = image
        out = [None if image is None else torch.from_dlpack(image) for image in images]
        for i in [i for i, tensor in enumerate(out) if tensor is None]:
            out[i] = self._on_cpu(streams[i], names[i])
        for image, size, name in zip(out, sizes, names):
            if list(image.shape[1:]) != list(size):  # the crop was drawn for the size in the header
                raise DataError(
                    f"cannot decode the image {name}: its header says {size[0]} x {size[1]} pixels, "
                    f"the decoder gave {image.shape[1]} x {image.shape[2]}; remove or replace it"
                )
        return out

    def _on_cpu(self, stream, name: str) -> torch.Tensor:
        image = self.cpu.decode(stream, params=self.params)
        if image is None:
            raise DataError(f"cannot decode the image {name} (a damaged or unsupported JPEG); remove or replace it")
        return torch.from_numpy(np.array(image)).to(self.device, non_blocking=False)


def checked_streams(files: Sequence[np.ndarray], names: Sequence[str], sizes: Sequence[Sequence[int]]) -> list:
    """nvImageCodec's code streams of the files, each header parsed and refused unless it reads the size PIL read in
    the loader worker (whose decompression-bomb check bounds it): a file crafted to read small to PIL and huge to
    the GPU decoder allocates nothing."""
    codec = nvimgcodec()
    streams = []
    for data, name, size in zip(files, names, sizes):
        try:
            stream = codec.CodeStream(data)
            found = [stream.height, stream.width]  # parsed here
        except RuntimeError as e:  # not even a readable header
            raise DataError(f"cannot decode the image {name} ({e}); remove or replace it") from None
        if found != list(size):
            raise DataError(
                f"cannot decode the image {name}: its header reads {size[0]} x {size[1]} pixels to "
                f"PIL and {found[0]} x {found[1]} to nvImageCodec; remove or replace it"
            )
        streams.append(stream)
    return streams


def ends_whole(data: np.ndarray) -> bool:
    """Whether the file's end-of-image marker is near its end. A GPU decoder fills the missing rows of a
    truncated file in silence, where PIL (the CPU path) refuses it: files without the marker, truncated or
    followed by much other data, go to the CPU decoder, which tells."""
    tail = data[-1024:].tobytes()
    return b"\xff\xd9" in tail


_per_thread = threading.local()


def decoder_for(device: torch.device, backend: str) -> JpegDecoder:
    """A decoder per (device, backend) and thread, built once (it loads the codecs and probes the GPU): the
    prefetching thread decodes training batches while the main thread may decode validation ones."""
    decoders = _per_thread.__dict__.setdefault("decoders", {})
    key = (str(device), backend)
    if key not in decoders:
        decoders[key] = JpegDecoder(device, backend)
    return decoders[key]
