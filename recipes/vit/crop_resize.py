"""The augmentation of decoded images of different sizes, batched: each image's crop (training: its random
resized crop; validation: resize and centre crop), resized to the model's size, flipped, rounded as a uint8
image and normalized. On a GPU one Triton kernel does the whole batch (crop_kernels.py): one launch instead
of a few per image, which would hold the Python thread and queue hundreds of small kernels behind the
training step's. Elsewhere, and as the reference the kernel is tested against, torch does it image by image
with the Transform the loader workers use."""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import torch

BLOCK = 1024  # output pixels per program


def resized_shape(height: int, width: int, shorter: int) -> tuple[int, int]:
    """(height, width) after resizing the shorter side to `shorter`, as torchvision's resize computes it."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter * long / short)
    return (new_long, shorter) if width <= height else (shorter, new_long)


def window_params(
    crops: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], size: int, shorter: int
) -> list[list[int]]:
    """Per image: source window (top, left, height, width), resized size (height, width), the output's offset
    in the resized image (top, left), flip. A crop of height -1 is the validation geometry."""
    rows = []
    for (top, left, h, w, flip), (height, width) in zip(crops, sizes):
        if h >= 0:
            rows.append([top, left, h, w, size, size, 0, 0, flip])
        else:
            new_h, new_w = resized_shape(height, width, shorter)
            rows.append(
                [
                    0,
                    0,
                    height,
                    width,
                    new_h,
                    new_w,
                    int(round((new_h - size) / 2.0)),
                    int(round((new_w - size) / 2.0)),
                    0,
                ]
            )
    return rows


@functools.cache
def _statistics(device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]):
    return (
        torch.tensor(mean, dtype=torch.float32, device=device),
        torch.tensor(std, dtype=torch.float32, device=device),
    )


def crop_resize_normalize(
    images: Sequence[torch.Tensor], crops: Sequence[Sequence[int]], transform, use_kernel: bool | None = None
) -> torch.Tensor:
    """uint8 [3, H, W] images -> normalized float [N, 3, S, S]: the Transform's geometry, flip and
    normalization with the given crops. use_kernel: the Triton kernel (default: on CUDA)."""
    if use_kernel is None:
        use_kernel = images[0].is_cuda
    if not use_kernel:
        pixels = torch.stack([transform.geometry(image.float(), crop) for image, crop in zip(images, crops)])
        pixels = pixels.round_().clamp_(0, 255)  # resized in float, rounded as the uint8 resize rounds
        flips = [i for i, crop in enumerate(crops) if crop[4]]
        if flips:  # one flip and one normalization for the whole batch
            pixels[flips] = pixels[flips].flip(-1)
        return transform.normalize(pixels.div_(255))
    from recipes.vit.crop_kernels import crop_resize_normalize as kernel

    device, size = images[0].device, transform.size
    if any(image.shape[0] != 3 for image in images):
        raise ValueError("crop_resize_normalize: expected 3-channel images")
    flat = torch.cat([image.reshape(-1) for image in images])
    starts = itertools.accumulate((image.numel() for image in images[:-1]), initial=0)
    rows = window_params(crops, [image.shape[1:] for image in images], size, transform.resize)
    windows = torch.tensor(
        [[start, image.shape[1], image.shape[2], *row] for start, image, row in zip(starts, images, rows)],
        dtype=torch.int64,
    )
    windows = windows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else windows
    mean, std = _statistics(device, tuple(transform.mean), tuple(transform.std))
    out = torch.empty(len(images), 3, size, size, dtype=torch.float32, device=device)
    kernel[(len(images), 3, -(-size * size // BLOCK))](flat, windows, mean, std, out, SIZE=size, BLOCK=BLOCK)
    return out
