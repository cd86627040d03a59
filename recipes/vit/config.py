"""Schemas of the ViT recipe's `model` and `data` config groups (defaults: ViT-B/16 at 224 px)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Optional

from core.config.errors import require
from core.config.ranges import EPSILON_MIN, INT32_MAX, Int, Numbers, Real, Rule
from core.config.schema import DataConfig, ModelConfig

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class ImageFormat(StrEnum):
    # What each layout holds and what is left out (hidden, unreadable, classless files): recipes/vit/folders.py
    imagefolder = "imagefolder"  # <root>/<train_split>/<class>/**/*.png|jpg ...
    tiny_imagenet = "tiny_imagenet"  # <root>/train/<wnid>/images/*.JPEG, <root>/val/images + val_annotations.txt
    synthetic = "synthetic"  # random images and labels, for throughput measurements
    # <root>/index.json, <root>/<split>-NNNNNN.tar: tar shards that scripts/shard_images.py wrote
    # (recipes/vit/shards.py)
    shards = "shards"


class DecodeOn(StrEnum):
    # PIL in the loader workers, then the crop and flip there; uint8 images normalized on the device. The
    # default: with a core per worker it fed the shipped ViT-B as fast as synthetic images, where decoding on
    # the GPU did not (docs/performance.md, "Real JPEGs while training").
    workers = "workers"
    # The workers only read the bytes and draw the crop/flip; the training device decodes (nvImageCodec:
    # recipes/vit/jpeg.py) and crops, resizes and normalizes, on a thread a step ahead (core/data/loading.py):
    # leaves the CPU cores free where a GPU has few. JPEG only, no mixup/cutmix.
    device = "device"


class DeviceDecoder(StrEnum):
    # decode_on=device on a GPU. The hardware JPEG engines (A100, H100, H200, ...) are the fastest where a GPU
    # has them (docs/performance.md).
    auto = "auto"  # hardware where the GPU has JPEG engines, else cuda
    hardware = "hardware"
    cuda = "cuda"  # nvJPEG's CUDA kernels, Huffman decoding on CPU threads
    # An NVIDIA DALI pipeline decodes, crops, resizes, flips and normalizes each training micro-batch, batched in
    # C++ (hardware engines where the GPU has them): less Python per image (recipes/vit/dali_crops.py).
    dali = "dali"


@dataclass
class ViTModelConfig(ModelConfig):
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: Optional[int] = 1000  # the configs set ${data.num_classes}
    hidden_size: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    layernorm_epsilon: float = 1e-6
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # One fused QKV weight per block (one GEMM); False: separate query/key/value weights.
    fuse_qkv_params: bool = True
    init_std: float = 0.02
    label_smoothing: float = 0.0

    RANGES: ClassVar[dict[str, Rule]] = {
        "img_size": Int(1, INT32_MAX),
        "patch_size": Int(1, INT32_MAX),
        "in_chans": Int(1, INT32_MAX),
        "num_classes": Int(1, INT32_MAX),
        "hidden_size": Int(1, INT32_MAX),
        "depth": Int(1, INT32_MAX),
        "num_heads": Int(1, INT32_MAX),
        "mlp_ratio": Real(0, 64, open_low=True),  # the MLP's width over hidden_size
        "layernorm_epsilon": Real(EPSILON_MIN, 1),
        "hidden_dropout": Real(0, 1),
        "attention_dropout": Real(0, 1),
        # Weights are drawn from a normal truncated at +-2 init_std: torch divides by it, and below 1e-6 they
        # start as good as zero anyway.
        "init_std": Real(1e-6, 1),
        "label_smoothing": Real(0, 1),
    }

    @staticmethod
    def check(c, key: str) -> None:
        """What recipes/vit/model.py builds from these sizes."""
        require(
            c.hidden_size % c.num_heads == 0,
            f"{key}.hidden_size={c.hidden_size} and {key}.num_heads={c.num_heads}: expected hidden_size divisible "
            "by num_heads (each head takes hidden_size / num_heads of it)",
        )
        require(
            c.img_size % c.patch_size == 0,
            f"{key}.img_size={c.img_size} and {key}.patch_size={c.patch_size}: expected img_size divisible by "
            "patch_size (the image is cut into whole patches)",
        )
        require(
            int(c.hidden_size * c.mlp_ratio) >= 1,
            f"{key}.mlp_ratio={c.mlp_ratio} and {key}.hidden_size={c.hidden_size}: the MLP's width "
            f"int(hidden_size * mlp_ratio) is {int(c.hidden_size * c.mlp_ratio)}; expected at least 1",
        )


@dataclass
class ImageDataConfig(DataConfig):
    format: ImageFormat = ImageFormat.imagefolder
    # The model's head size follows this (model.num_classes: ${data.num_classes}). null: the number of
    # classes the training split holds (imagefolder: class folders with images; tiny_imagenet: training
    # wnids with images, in wnids.txt order); a number that differs from the data's is an error.
    num_classes: Optional[int] = None
    # A missing root with <root>.tar.gz (or .tgz / .tar) beside it is extracted there on first use.
    root: Optional[str] = None
    train_split: str = "train"
    val_split: str = "val"
    # Training augmentation: random resized crop with this area range, horizontal flip probability.
    train_crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    train_crop_ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    # Mixup / CutMix, per sample: a training image is blended with (mixup) or gets a box pasted from
    # (cutmix) a partner image drawn from the sample's own (seed, epoch, idx), with weight / box area
    # from Beta(alpha, alpha); the sample then carries a soft "target". 0 turns each off (e.g. 0.8, 1.0).
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0  # the share of training samples that are mixed
    mix_switch_prob: float = 0.5  # with both on: the chance of cutmix rather than mixup
    # Validation: resize the shorter side to img_size / val_crop_fraction, then center-crop img_size.
    val_crop_fraction: float = 0.875
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    num_workers: int = 4
    # Read every image file's header when the dataset is built (threads) and leave out the unreadable ones,
    # logged; false: skip it (a bad file then stops the run when a loader worker reads it, naming the file).
    verify_images: bool = True
    decode_on: DecodeOn = DecodeOn.workers
    device_decoder: DeviceDecoder = DeviceDecoder.auto
    # decode_on=device: micro-batches decoded at once, each on its own thread and CUDA stream. More than one
    # has not been faster: nvImageCodec decoders in several threads slow each other (docs/performance.md).
    decode_threads: int = 1
    # synthetic format only: number of samples per split
    synthetic_train_size: int = 100_000
    synthetic_val_size: int = 1_000

    RANGES: ClassVar[dict[str, Rule]] = {
        "num_classes": Int(1, INT32_MAX),
        # Of the image's area: below 1e-3, a crop of a 32 x 32 image is under one pixel (and falls back to the
        # whole image).
        "train_crop_scale": Numbers(Real(1e-3, 1), length=2, ordered=True),
        "train_crop_ratio": Numbers(Real(0.01, 100), length=2, ordered=True),  # width / height
        "hflip": Real(0, 1),
        "mixup_alpha": Real(0, 100, note="0: off"),  # Beta(alpha, alpha): above, the weight is close to 0.5
        "cutmix_alpha": Real(0, 100, note="0: off"),
        "mix_prob": Real(0, 1),
        "mix_switch_prob": Real(0, 1),
        "val_crop_fraction": Real(0.1, 1),  # the resized image is at most 10x the crop
        # Pixels are in [0, 1] when they are normalized: a mean outside that, or a std above 1 (no scaling),
        # is in other units (e.g. 0-255). Normalized pixels reach 1 / std: below 1e-3, the first layer's sums of
        # hundreds of them near fp16's largest number (65504), and a denormal std is 0 in fp32 (inf pixels); real
        # image sets vary far more (ImageNet: 0.22).
        "mean": Numbers(Real(0, 1)),
        "std": Numbers(Real(1e-3, 1)),
        "decode_threads": Int(1, 16),
        "synthetic_train_size": Int(1, INT32_MAX),
        "synthetic_val_size": Int(1, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(
            len(c.mean) == len(c.std),
            f"{key}.mean={list(c.mean)} and {key}.std={list(c.std)}: expected one value per channel in each",
        )
        require(
            c.num_classes is not None or c.format != ImageFormat.synthetic,
            f"{key}.format=synthetic needs {key}.num_classes (random labels come from no folder)",
        )
        mixes = c.mixup_alpha > 0 or c.cutmix_alpha > 0
        require(
            not (c.decode_on == DecodeOn.device and (c.format == ImageFormat.synthetic or mixes)),
            f"{key}.decode_on=device needs JPEG files and no mixup/cutmix (they mix decoded images); "
            f"use {key}.decode_on=workers",
        )
