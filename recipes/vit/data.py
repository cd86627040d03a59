"""Image-classification datasets for the ViT recipe: ImageFolder, Tiny-ImageNet and synthetic.

Every dataset returns dict samples {"image": [C, H, W], uint8 from image files (the recipe's to_device
normalizes it where the batch trains), floats from SyntheticImages; "label": int; "idx": int}
and takes an int or a core.data.datasets.EpochIndex. Random augmentation comes from the (seed, epoch, idx)
of the sample, never from the global RNGs (core/data/checks.py verifies that in the tests).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision.transforms import v2

from core.config.errors import ConfigError, DataError, MissingDataError
from core.config.file_shape import NotThisKindOfFile
from core.data.datasets import EpochIndex, epoch_index, mix_seed, sample_generator
from recipes.vit.archive import extract_beside
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.folders import (
    imagefolder_classes,
    imagefolder_files,
    readable,
    tiny_imagenet_classes,
    tiny_imagenet_files,
    unlabeled_files,
)
from recipes.vit.image_header import DECODE_ERRORS, NotAnImageFile, read_image_file, rgb, size_problem
from recipes.vit.shards import ShardFiles, ShardReader, read_index

log = logging.getLogger(__name__)


def ensure_extracted(root: str, given: Optional[str] = None) -> Path:
    """Return `root`; if it is missing but `<root>.tar.gz` (.tgz, .tar) exists, extract it first (archive.py).
    `given`: the setting or option that gave `root`, for messages (default `data.root=<root>`)."""
    with named(given or f"data.root={root}"):
        return extract_beside(root)


@contextlib.contextmanager
def named(setting: Optional[str]) -> Iterator[None]:
    """A DataError raised inside names `setting` (the setting or option that gave the path, `data.root=...`)
    first, once: the message says which file, this says where it came from."""
    try:
        yield
    except DataError as e:
        if setting is None or getattr(e, "setting", None) is not None or str(e).startswith(setting):
            raise
        named_error = type(e)(f"{setting}: {e}")
        named_error.setting = setting
        raise named_error.with_traceback(e.__traceback__) from None


def refuse_a_header_that_does_not_fit(img: Image.Image, file_bytes: int, path: str) -> None:
    """A DataError naming the file when its header's pixels and its size do not fit together (recipes/vit/
    image_header.py), before anything is decoded."""
    problem = size_problem(img, file_bytes)
    if problem is not None:
        raise DataError(f"cannot decode the image {path} ({problem}); remove or replace it")


class ImageSamples(Dataset):
    """{"image" (uint8, cropped and flipped: Transform), "label", "idx"} samples from (file, label) pairs, the
    files' bytes read by `reader` (by position) when given (tar shards: recipes/vit/shards.py), else from the
    files. A file that cannot be read or decoded is a DataError naming it and `given` (the setting that gave the
    files, `data.root=...`), also in a loader worker.

    Takes an int or an EpochIndex: the training augmentation draws from sample_generator(seed, epoch,
    idx), so a sample is the same on every call, rank and loader worker, and differs between epochs.
    """

    def __init__(
        self,
        files: Sequence[tuple[str, int]],
        transform: Transform,
        seed: int,
        reader: Optional[Callable[[int], bytes]] = None,
        given: Optional[str] = None,
    ):
        self.files, self.transform, self.seed, self.reader, self.given = files, transform, seed, reader, given

    def __len__(self) -> int:
        return len(self.files)

    def fingerprint(self) -> bytes:
        """Each sample's file and label, in order (core/data/fingerprint.py): a resume notices files added,
        removed or renamed, and class folders renamed, which relabel the classes sorted after them."""
        own = getattr(self.files, "fingerprint", None)
        if own is not None:
            return own()
        return "\n".join(f"{label}\t{path}" for path, label in self.files).encode("utf-8", "surrogateescape")

    def read(self, idx: int) -> bytes:
        if self.reader is not None:
            return self.reader(idx)
        path = self.files[idx][0]
        try:
            return read_image_file(path)
        except NotAnImageFile as e:
            raise DataError(f"cannot decode the image {path} ({e}); remove or replace it") from None
        except NotThisKindOfFile as e:  # a FIFO, a device: never waited on
            raise DataError(f"cannot read the image {path} ({e}); remove or replace it") from None
        except OSError as e:  # gone or changed since the folder was listed
            raise DataError(f"cannot read the image {path} ({e.strerror}); remove or replace it") from None

    def __getitem__(self, index: EpochIndex | int) -> dict:
        epoch, idx = epoch_index(index)
        path, label = self.files[idx]
        with named(self.given):
            raw = self.read(idx)
            try:
                with Image.open(io.BytesIO(raw)) as img:
                    refuse_a_header_that_does_not_fit(img, len(raw), path)
                    image = self.transform.from_pil(img, sample_generator(self.seed, epoch, idx))
            except DECODE_ERRORS as e:  # header fine, pixels not (truncated, corrupt)
                raise DataError(
                    f"cannot decode the image {path} ({type(e).__name__}: {e}); remove or replace it"
                ) from None
        return {"image": image, "label": label, "idx": idx}


class SyntheticImages(Dataset):
    """Random normal images (floats: to_device leaves them as they are) and uniform labels, the same for a given
    index on every call and rank."""

    def __init__(self, size: int, image_size: int, channels: int, num_classes: int, seed: int):
        self.size, self.shape, self.num_classes, self.seed = size, (channels, image_size, image_size), num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: EpochIndex | int) -> dict:
        idx = epoch_index(index).idx  # the same image in every epoch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        return {
            "image": torch.randn(self.shape, generator=g),
            "label": int(torch.randint(self.num_classes, (), generator=g)),
            "idx": idx,
        }


def random_resized_crop_box(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], g: torch.Generator
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a crop covering a random fraction of the area in `scale` with an aspect
    ratio in `ratio` (log-uniform), up to 10 tries, else the largest central crop within `ratio`."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        u = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        target = area * (scale[0] + u[0] * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u[1] * (log_hi - log_lo))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=g))
            left = int(torch.randint(0, width - w + 1, (), generator=g))
            return top, left, h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class Transform:
    """uint8 [C, H, W] image + the sample's generator -> uint8 image of img_size, cropped and flipped; `normalize`
    makes floats of it where the batch trains (the ViT recipe's to_device), so loader workers hand over a
    quarter of the bytes.

    In two halves, so the random draws can happen where the file is read and the pixel work where the
    image is decoded (data.decode_on=device): `draw` picks the crop and flip from the image size alone,
    `apply` does them. A crop is [top, left, height, width, flip]; height -1 means the validation
    geometry (shorter side resized, centre crop)."""

    def __init__(self, data: ImageDataConfig, image_size: int, train: bool):
        self.train, self.size = train, image_size
        self.scale, self.ratio, self.hflip = tuple(data.train_crop_scale), tuple(data.train_crop_ratio), data.hflip
        self.resize = round(image_size / data.val_crop_fraction)
        self.mean, self.std = list(data.mean), list(data.std)

    def from_pil(self, img: Image.Image, g: torch.Generator) -> torch.Tensor:
        """The same pixels as `apply` on the whole image made a tensor, for less work in a loader worker: a
        training crop is cut from the decoded image before its pixels are copied into a tensor (and before a
        colour conversion, which is per pixel), so only the crop's pixels are copied."""
        crop = self.draw(img.height, img.width, g)
        top, left, h, w, flip = crop
        if h >= 0:
            img, crop = img.crop((left, top, left + w, top + h)), [0, 0, h, w, flip]
        return self.apply(torch.from_numpy(np.array(rgb(img))).permute(2, 0, 1), crop)

    def draw(self, height: int, width: int, g: torch.Generator) -> list[int]:
        if not self.train:
            return [0, 0, -1, -1, 0]
        top, left, h, w = random_resized_crop_box(height, width, self.scale, self.ratio, g)
        flip = self.hflip > 0 and float(torch.rand((), generator=g)) < self.hflip
        return [top, left, h, w, int(flip)]

    def apply(self, image: torch.Tensor, crop: list[int]) -> torch.Tensor:
        image = self.geometry(image, crop)
        return image.flip(-1) if crop[4] else image

    def geometry(self, image: torch.Tensor, crop: list[int]) -> torch.Tensor:
        """The crop (training: random resized crop; validation: resize + centre crop) -> uint8 [C, S, S]."""
        top, left, h, w, _ = crop
        if h >= 0:
            return v2.functional.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True)
        image = v2.functional.resize(image, self.resize, antialias=True)
        return v2.functional.center_crop(image, [self.size, self.size])

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 image(s) -> normalized floats."""
        return v2.functional.normalize(v2.functional.to_dtype(images, torch.float32, scale=True), self.mean, self.std)


class EncodedImageSamples(ImageSamples):
    """data.decode_on=device: {"jpeg": the file's bytes, "crop": the sample's augmentation drawn from
    its (seed, epoch, idx) and the size in the JPEG header, "size": that (height, width), "path", "label",
    "idx"}; `decode_batch` finishes the job on the training device. The same crops and flips as ImageSamples
    draws."""

    def __getitem__(self, index: EpochIndex | int) -> dict:
        epoch, idx = epoch_index(index)
        path, label = self.files[idx]
        with named(self.given):
            raw = self.read(idx)
            if raw[:2] != b"\xff\xd8":
                raise DataError(
                    f"data.decode_on=device decodes JPEG files only, and {path} is not one "
                    "(use data.decode_on=workers for other formats)"
                )
            try:
                with Image.open(io.BytesIO(raw)) as img:  # parses the header only
                    refuse_a_header_that_does_not_fit(img, len(raw), path)
                    width, height = img.size
            except DECODE_ERRORS as e:
                raise DataError(
                    f"cannot decode the image {path} ({type(e).__name__}: {e}); remove or replace it"
                ) from None
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        crop = self.transform.draw(height, width, sample_generator(self.seed, epoch, idx))
        return {
            "jpeg": data,
            "crop": torch.tensor(crop),
            "size": torch.tensor([height, width]),
            "path": str(path),
            "label": label,
            "idx": idx,
        }


def collate_encoded(samples: list[dict]) -> dict:
    """Encoded samples -> a batch: the JPEG byte strings joined into one tensor (one shared-memory block
    from a loader worker, not one per image) with their lengths; the rest collated as usual (paths: a list)."""
    rest = default_collate([{k: v for k, v in s.items() if k != "jpeg"} for s in samples])
    return {
        "jpeg": torch.cat([s["jpeg"] for s in samples]),
        "jpeg_sizes": torch.tensor([s["jpeg"].numel() for s in samples]),
        **rest,
    }


HOST_ONLY = ("jpeg", "jpeg_sizes", "crop", "size", "path")


def encoded_files(batch: dict) -> list[np.ndarray]:
    """A collate_encoded batch's files, each a view of its bytes in the joined tensor (host tensors: no device
    sync)."""
    ends = batch["jpeg_sizes"].cumsum(0).tolist()
    joined = batch["jpeg"].numpy()
    return [joined[end - size : end] for end, size in zip(ends, batch["jpeg_sizes"].tolist())]


def decode_batch(batch: dict, transform: Transform, device: torch.device, backend: str = "auto") -> dict:
    """Decode a collate_encoded batch on `device` (recipes/vit/jpeg.py: the GPU's JPEG engines where it has
    them), then crop, resize, flip and normalize there with the crops the workers drew (recipes/vit/
    crop_resize.py): float images equal to ImageSamples' up to the decoders' and resizers' rounding. On CUDA,
    queued on the current stream."""
    from recipes.vit.crop_resize import crop_resize_normalize
    from recipes.vit.dali_crops import dali_crops
    from recipes.vit.jpeg import checked_streams, decoder_for

    files = encoded_files(batch)
    crops, sizes = batch["crop"].tolist(), batch["size"].tolist()
    pixels = None
    if backend == "dali" and all(crop[2] >= 0 for crop in crops):  # training crops (recipes/vit/dali_crops.py)
        checked_streams(files, batch["path"], sizes)
        pixels = dali_crops(files, crops, transform.size, transform.mean, transform.std, device)
    if pixels is None:
        images = decoder_for(device, "auto" if backend == "dali" else backend).decode(files, batch["path"], sizes)
        pixels = crop_resize_normalize(images, crops, transform)  # one kernel for the batch on a GPU
    rest = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k not in HOST_ONLY}
    return {"image": pixels, **rest}


def build_image_datasets(data: ImageDataConfig, model: ViTModelConfig, seed: int) -> tuple[Dataset, Optional[Dataset]]:
    """Training and validation sets."""
    ImageDataConfig.check(data, "data")  # also for configs that did not come through validation
    train, val = _image_datasets(data, model, seed)
    if data.mixup_alpha > 0 or data.cutmix_alpha > 0:
        normalize = Transform(data, model.img_size, train=True).normalize
        train = MixupCutmix(
            train,
            model.num_classes,
            data.mixup_alpha,
            data.cutmix_alpha,
            data.mix_prob,
            data.mix_switch_prob,
            seed,
            normalize,
        )
    return train, val


def _image_datasets(data: ImageDataConfig, model: ViTModelConfig, seed: int) -> tuple[Dataset, Optional[Dataset]]:
    size = model.img_size
    if data.format == "synthetic":
        return (
            SyntheticImages(data.synthetic_train_size, size, model.in_chans, model.num_classes, seed),
            SyntheticImages(data.synthetic_val_size, size, model.in_chans, model.num_classes, seed + 1),
        )
    classes = image_classes(data)
    if len(classes) != model.num_classes:
        raise DataError(f"data.root={data.root} has {len(classes)} classes but model.num_classes={model.num_classes}")
    if data.decode_on == "device":
        from recipes.vit.dali_crops import dali_modules
        from recipes.vit.jpeg import nvimgcodec

        nvimgcodec()  # here, before any work: the decoder's package is missing, or loads from the main thread
        if data.device_decoder == "dali":
            dali_modules()
    samples = EncodedImageSamples if data.decode_on == "device" else ImageSamples
    train = split_samples(samples, data, data.train_split, classes, Transform(data, size, train=True), seed)
    if train is None:
        raise DataError(f"data.root={data.root}: no training split {data.train_split!r} (data.train_split)")
    val = split_samples(samples, data, data.val_split, classes, Transform(data, size, train=False), seed)
    if val is None:  # a misspelt data.val_split would otherwise only drop validation, in a line of the info log
        log.warning(
            "data.val_split=%s: data.root=%s has no such split%s; the run trains without validation",
            data.val_split,
            data.root,
            _other_folders(data),
        )
    return train, val


def _other_folders(data: ImageDataConfig) -> str:
    """`(its folders: a, b)`: the folders of an imagefolder root besides the training split, where a misspelt
    validation split would be; empty for other formats."""
    if data.format != "imagefolder":
        return ""
    root = Path(data.root)
    folders = (
        sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != data.train_split) if root.is_dir() else []
    )
    return f" (its folders besides {data.train_split}: {', '.join(folders) or 'none'})"


def _root_setting(data: ImageDataConfig, given: Optional[str]) -> str:
    return given or f"data.root={data.root}"


def split_samples(
    samples: type[ImageSamples], data: ImageDataConfig, split: str, classes: list[str], transform: Transform, seed: int
) -> Optional[ImageSamples]:
    """One split's samples (None if the data has no such split): from its files, or from tar shards."""
    given = _root_setting(data, None)
    if data.format != "shards":
        files = split_files(data, split, classes)
        return samples(files, transform, seed, given=given) if files is not None else None
    with named(given):
        found, splits = read_index(ensure_extracted(data.root))
        if found != classes:
            raise DataError(f"the shards' classes differ from the ones given ({len(found)} against {len(classes)})")
        if split not in splits:
            log.info("%s: no %s split", data.root, split)
            return None
        if not len(splits[split]):
            raise DataError(f"split {split!r} holds no samples")
        if split == data.train_split:  # as for a folder: a class without training images is a head row never trained
            counts = np.bincount(np.asarray(splits[split].table[:, 4]), minlength=len(classes))
            if not counts.all():
                empty = [c for c, n in zip(classes, counts) if not n]
                raise DataError(f"{len(empty)} classes have no training samples: {', '.join(empty[:5])}")
    return samples(ShardFiles(splits[split]), transform, seed, ShardReader(splits[split]), given=given)


def image_classes(data: ImageDataConfig, given: Optional[str] = None) -> list[str]:
    """The class names of an image dataset, in label order (recipes/vit/folders.py says which). `given`: the
    setting or option that gave data.root, for messages."""
    if data.root is None:
        raise MissingDataError(f"data.root is not set (data.format={data.format} reads its images from it)")
    if data.format not in ("imagefolder", "tiny_imagenet", "shards"):
        raise ConfigError(
            f"data.format={data.format!r} has no class names (expected imagefolder, tiny_imagenet or shards)"
        )
    with named(_root_setting(data, given)):
        root = ensure_extracted(data.root, given)
        if data.format == "imagefolder":
            return imagefolder_classes(root / data.train_split)
        if data.format == "tiny_imagenet":
            return tiny_imagenet_classes(root)
        return read_index(root)[0]


def split_files(
    data: ImageDataConfig, split: str, classes: list[str], given: Optional[str] = None
) -> Optional[list[tuple[str, int]]]:
    """(image, label) of one split, unreadable files left out (data.verify_images); None if it does not exist."""
    with named(_root_setting(data, given)):
        root = ensure_extracted(data.root, given)
        if data.format == "tiny_imagenet":
            files = tiny_imagenet_files(root, split, classes)
        elif (root / split).is_dir():
            files = imagefolder_files(root / split, classes)
        else:
            files = None
        if files is None:
            log.info("%s: no %s split", root, split)
            return None
        if data.verify_images:
            files = readable(files, str(root / split))
        if not files:
            raise DataError(f"{root / split}: no readable images of the training classes")
        if split == data.train_split:  # a class whose every image is unreadable would be a head row never trained
            labels = {label for _, label in files}
            empty = [c for i, c in enumerate(classes) if i not in labels]
            if empty:
                raise DataError(
                    f"{root / split}: {len(empty)} classes have no readable images: "
                    f"{', '.join(empty[:5])} (replace the files or remove the class folders)"
                )
    return files


def default_prediction_split(data: ImageDataConfig) -> str:
    """ "test" where the data has that split (a folder of the root holding labelled images, a split of the shards),
    else "val". Tiny ImageNet's test images carry no labels: its default is val."""
    if data.format == "tiny_imagenet" or data.root is None:  # (without a root, the split says what is missing)
        return "val"
    root = ensure_extracted(data.root)
    has_test = "test" in read_index(root)[1] if data.format == "shards" else (root / "test").is_dir()
    return "test" if has_test else "val"


def prediction_samples(
    data: ImageDataConfig,
    model: ViTModelConfig,
    seed: int,
    split: Optional[str],
    folder: Optional[str],
    classes: Optional[list[str]] = None,
) -> ImageSamples:
    """predict.py's images, with the validation transform: a split of the data (labels in `classes` order,
    read from the data when not given), or every image under `folder` (unlabeled, label -1)."""
    transform = Transform(data, model.img_size, train=False)
    if folder is None:
        split = {"train": data.train_split, "val": data.val_split}.get(split, split)  # the names predict.py knows
        found = split_samples(
            ImageSamples, data, split, classes if classes is not None else image_classes(data), transform, seed
        )
        if found is None:
            raise DataError(f"predict.split={split}: {data.root} has no such split")
        return found
    given = f"predict.folder={folder}"
    with named(given):
        files = unlabeled_files(Path(folder))
        files = readable(files, folder) if data.verify_images else files
        if not files:
            raise DataError(f"{folder}: no readable images")
    return ImageSamples(files, transform, seed, given=given)


class ImagesToPredict(Dataset):
    """predict.py's images (`samples`), with what names its output rows: file names are written relative to
    `base` (the data root, or the folder predicted on), top classes by `class_names` (None: not known)."""

    def __init__(self, samples: ImageSamples, base: Path, class_names: Optional[list[str]]):
        self.samples, self.base, self.class_names = samples, base, class_names

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


MIX_STREAM = 0x6D6978  # keeps the mixing draws apart from the sample's augmentation draws


class MixupCutmix(Dataset):
    """Mixup (Zhang et al., 2018) and CutMix (Yun et al., 2019) applied per sample, not per batch.

    Sample (epoch, idx) draws from (seed, epoch, idx) alone whether it is mixed, its partner (any index of
    the dataset, augmented as that index is in this epoch), the method and the weight lam ~ Beta(alpha,
    alpha); so it is the same on every call, rank and loader worker, whatever the batch it lands in.
    Adds "target": the label distribution, lam * one_hot(label) + (1 - lam) * one_hot(partner label)
    (one_hot(label) for unmixed samples). Costs a second image decode for each mixed sample. Images are mixed
    as floats: uint8 ones are made so by `normalize` first (every sample, mixed or not: one dtype per batch)."""

    def __init__(
        self,
        dataset: Dataset,
        num_classes: int,
        mixup_alpha: float,
        cutmix_alpha: float,
        prob: float,
        switch_prob: float,
        seed: int,
        normalize: Optional[Callable] = None,
    ):
        if mixup_alpha < 0 or cutmix_alpha < 0 or not 0 <= prob <= 1 or not 0 <= switch_prob <= 1:
            raise ValueError(
                f"mixup_alpha={mixup_alpha}, cutmix_alpha={cutmix_alpha} must be >= 0 and "
                f"mix_prob={prob}, mix_switch_prob={switch_prob} in [0, 1]"
            )
        self.dataset, self.num_classes, self.seed = dataset, num_classes, seed
        self.mixup_alpha, self.cutmix_alpha, self.prob, self.switch_prob = mixup_alpha, cutmix_alpha, prob, switch_prob
        self.normalize = normalize

    def _sample(self, epoch: int, idx: int) -> dict:
        sample = dict(self.dataset[EpochIndex(epoch, idx)])
        if self.normalize is not None and sample["image"].dtype == torch.uint8:
            sample["image"] = self.normalize(sample["image"])
        return sample

    def __len__(self) -> int:
        return len(self.dataset)

    def _one_hot(self, label: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(label), self.num_classes).float()

    def __getitem__(self, index: EpochIndex | int) -> dict:
        epoch, idx = epoch_index(index)
        sample = self._sample(epoch, idx)
        sample["target"] = self._one_hot(sample["label"])
        rng = np.random.default_rng(mix_seed(self.seed, epoch, idx, MIX_STREAM))  # a private generator
        if self.mixup_alpha + self.cutmix_alpha == 0 or rng.random() >= self.prob:
            return sample
        partner = self._sample(epoch, int(rng.integers(len(self.dataset))))
        image, other = sample["image"], partner["image"]
        if self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or rng.random() < self.switch_prob):
            # A box of area (1 - lam) of the image, centred at random and clipped at the borders.
            lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
            h, w = image.shape[-2:]
            cut_h, cut_w = round(h * np.sqrt(1 - lam)), round(w * np.sqrt(1 - lam))
            cy, cx = int(rng.integers(h)), int(rng.integers(w))
            top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h - cut_h // 2, h)
            left, right = max(cx - cut_w // 2, 0), min(cx + cut_w - cut_w // 2, w)
            image = image.clone()
            image[..., top:bottom, left:right] = other[..., top:bottom, left:right]
            lam = 1.0 - (bottom - top) * (right - left) / (h * w)  # the share actually kept
        else:
            lam = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
            image = lam * image + (1.0 - lam) * other
        sample["image"] = image
        sample["target"] = lam * sample["target"] + (1.0 - lam) * self._one_hot(partner["label"])
        return sample
