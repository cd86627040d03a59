"""Samplers (global stream split over ranks, exact validation coverage) and the ViT datasets."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.config.errors import DataError
from core.data.datasets import IdentityMultiEpochDatasetWrapper, MultiEpochDatasetResampler
from core.data.sampling import EvalBatchSampler, GlobalBatchSampler
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import ImageSamples, SyntheticImages, Transform, build_image_datasets, ensure_extracted
from recipes.vit.folders import tiny_imagenet_classes, tiny_imagenet_files
from tests.support.helpers import REPO


def step_indices(n, mb, gb, dp, steps, seed=7, consumed=0) -> list[list[int]]:
    """Dataset indices of each optimizer step, gathered over all ranks (sampler positions through the
    multi-epoch resampler, as in train.py)."""
    accum = gb // (mb * dp)
    stream = MultiEpochDatasetResampler(
        IdentityMultiEpochDatasetWrapper(list(range(n))), num_samples=consumed + steps * gb, seed=seed
    )
    iters = [iter(GlobalBatchSampler(mb, gb, dp, r, consumed_samples=consumed)) for r in range(dp)]
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            for it in iters:
                step += [stream[p] for p in next(it)]
        out.append(step)
    return out


def test_each_epoch_is_a_permutation_and_epochs_differ():
    n, gb = 24, 8  # 3 steps per epoch
    steps = step_indices(n, mb=2, gb=gb, dp=2, steps=6)
    epoch0, epoch1 = sum(steps[:3], []), sum(steps[3:], [])
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1
    assert step_indices(n, 2, gb, 2, 6) == steps  # reproducible


def test_epoch_boundary_inside_a_global_batch():
    n, gb = 10, 4  # epochs end mid-batch: the stream simply continues into the next permutation
    flat = sum(step_indices(n, 1, gb, 2, steps=5), [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


def test_global_batches_do_not_depend_on_world_size():
    one = step_indices(40, 8, 8, 1, steps=6)
    two = step_indices(40, 2, 8, 2, steps=6)
    four = step_indices(40, 1, 8, 4, steps=6)
    assert [sorted(s) for s in one] == [sorted(s) for s in two] == [sorted(s) for s in four]


def test_resume_position_continues_the_stream():
    full = step_indices(30, 2, 6, 3, steps=7)
    resumed = step_indices(30, 3, 6, 2, steps=3, consumed=4 * 6)  # other world size, from step 4
    assert [sorted(s) for s in resumed] == [sorted(s) for s in full[4:]]


@pytest.mark.parametrize("n,dp,bs", [(10, 3, 2), (7, 2, 4), (4, 4, 1), (3, 4, 2)])
def test_eval_sampler_covers_every_sample_once(n, dp, bs):
    samplers = [EvalBatchSampler(n, bs, dp, r) for r in range(dp)]
    assert len({len(s) for s in samplers}) == 1  # same number of forward passes on every rank
    seen = [i for s in samplers for batch in s for i in batch if i >= 0]
    assert sorted(seen) == list(range(n))
    limited = EvalBatchSampler(n, bs, dp, 0, limit_batches=1)
    assert len(limited) == 1


def write_image_folder(root: Path, classes: int = 3, per_class: int = 2, size: int = 12) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
                    root / split / f"c{c}" / f"{i}.png"
                )


def _extract(root: str) -> int:
    return len(list(ensure_extracted(root).rglob("*.png")))


@pytest.mark.slow
def test_tar_gz_beside_missing_root_is_extracted_once(tmp_path):
    src = tmp_path / "src" / "mydata"
    write_image_folder(src)
    archive = tmp_path / "data" / "mydata.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="mydata")
    root = str(tmp_path / "data" / "mydata")
    with multiprocessing.get_context("spawn").Pool(3) as pool:  # several ranks at once
        counts = pool.map(_extract, [root] * 3)
    assert counts == [12, 12, 12]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["mydata", "mydata.lock", "mydata.tar.gz"]


def test_missing_root_without_archive_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.root"):
        ensure_extracted(str(tmp_path / "nothing"))


def _archive(tmp_path: Path) -> Path:
    """<tmp>/data/mydata.tar.gz of a 3-class image folder under mydata/."""
    src = tmp_path / "src" / "mydata"
    write_image_folder(src)
    archive = tmp_path / "data" / "mydata.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="mydata")
    return archive


@pytest.mark.parametrize("damage", ["cut short", "not an archive", "a member outside"])
def test_a_failed_extraction_is_one_error_naming_the_archive_and_leaves_nothing(tmp_path, damage):
    archive = _archive(tmp_path)
    if damage == "cut short":
        archive.write_bytes(archive.read_bytes()[:300])
    elif damage == "not an archive":
        archive.write_bytes(b"<html>404 not found</html>")
    else:
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(tmp_path / "src" / "mydata", arcname="../escaped")
    root = str(tmp_path / "data" / "mydata")
    for attempt in range(2):  # a retry fails the same way, and leaves nothing either
        with pytest.raises(DataError, match=rf"^data.root={root}: {archive}: cannot be extracted \(\w+"):
            ensure_extracted(root)
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["mydata.lock", "mydata.tar.gz"]
    with pytest.raises(DataError, match=rf"^--root {root}: {archive}: cannot be extracted"):
        ensure_extracted(root, given=f"--root {root}")
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_an_archive_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path, kind):
    archive = tmp_path / "mydata.tar.gz"
    if kind == "a FIFO":
        os.mkfifo(archive)  # reading it would wait for a writer forever
    else:
        archive.mkdir()
    (tmp_path / "link.tar").symlink_to(archive)
    for name in ("mydata", "link"):
        with pytest.raises(
            DataError, match=rf"^data.root={tmp_path / name}: {tmp_path / name}.tar(.gz)?: it is {kind}"
        ):
            ensure_extracted(str(tmp_path / name))
    assert not (tmp_path / "mydata").exists() and not (tmp_path / "link").exists()


@pytest.mark.parametrize(
    "link,target", [("mydata", "."), ("mydata/train/c0", "../../beside"), ("mydata/up", "..")], ids=str
)
def test_an_archive_link_that_would_lead_beside_the_root_is_refused(tmp_path, link, target):
    """tarfile keeps links inside the extraction folder; once its top folder becomes the root, that folder is the
    root's parent: a link to it (or through it) would reach the files beside the root."""
    (tmp_path / "beside" / "c9").mkdir(parents=True)  # someone else's files beside the archive
    archive = tmp_path / "mydata.tar"
    with tarfile.open(archive, "w") as tar:
        if link != "mydata":
            info = tarfile.TarInfo("mydata/train")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        info = tarfile.TarInfo(link)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)
    root = tmp_path / "mydata"
    with pytest.raises(
        DataError, match=rf"^data.root={root}: {archive}: its member {link} is a link to {target}, (not|out)"
    ):
        ensure_extracted(str(root))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beside", "mydata.lock", "mydata.tar"]


def test_an_extraction_removes_the_leftovers_of_processes_that_are_gone_only(tmp_path):
    """A process killed while extracting leaves its folder: the next extraction removes those of this host's
    processes that are gone, never a running one's or another host's."""
    archive = _archive(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "60"])
    host = socket.gethostname()
    try:
        names = {
            f"mydata.extracting-{host}-{gone.pid}": False,
            f"mydata.extracting-{gone.pid}": False,
            f"mydata.extracting-{host}-{running.pid}": True,
            f"mydata.extracting-elsewhere-{gone.pid}": True,
        }
        for name in names:
            (archive.parent / name / "mydata" / "train").mkdir(parents=True)
            (archive.parent / name / "mydata" / "train" / "half.png").write_bytes(b"\x89PNG")
        root = ensure_extracted(str(archive.parent / "mydata"))
        assert len(list(root.rglob("*.png"))) == 12
        assert {name: (archive.parent / name).exists() for name in names} == names
    finally:
        running.kill()
        running.wait()


def test_tiny_imagenet_layout(tmp_path):
    rng = np.random.default_rng(0)
    wnids = ["n01", "n02"]
    for w in wnids:
        (tmp_path / "train" / w / "images").mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "train" / w / "images" / f"{w}_{i}.JPEG"
            )
    (tmp_path / "val" / "images").mkdir(parents=True)
    lines = []
    for i, w in enumerate(["n02", "n01", "n02"]):
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(
            tmp_path / "val" / "images" / f"val_{i}.JPEG"
        )
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t8\t8")
    (tmp_path / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    transform = Transform(ImageDataConfig(num_classes=2, val_crop_fraction=1.0), 8, train=False)
    classes = tiny_imagenet_classes(tmp_path)
    train_files = tiny_imagenet_files(tmp_path, "train", classes)
    val = ImageSamples(tiny_imagenet_files(tmp_path, "val", classes), transform, seed=0)
    assert classes == wnids and len(train_files) == 4
    assert [val[i]["label"] for i in range(3)] == [1, 0, 1]
    assert val[0]["image"].shape == (3, 8, 8)  # grayscale JPEGs become RGB


def test_shipped_digits_load_as_dict_samples():
    data = ImageDataConfig(
        format="imagefolder",
        root=str(REPO / "data" / "digits"),
        num_classes=10,
        train_crop_scale=[0.6, 1.0],
        hflip=0.0,
        val_crop_fraction=1.0,
        num_workers=0,
    )
    train, val = build_image_datasets(data, ViTModelConfig(img_size=28, patch_size=4, num_classes=10), seed=0)
    assert (len(train), len(val)) == (1438, 359)
    sample = val[0]
    assert sample["image"].shape == (3, 28, 28) and sample["image"].dtype == torch.uint8  # normalized on the device
    assert isinstance(sample["label"], int)
    labels = {val[i]["label"] for i in range(0, len(val), 7)}
    assert labels == set(range(10))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK", "P", "RGBA"])
def test_a_crop_cut_before_decoding_to_a_tensor_gives_the_whole_images_pixels(mode):
    """Workers cut the training crop out of the decoded image before copying pixels into a tensor
    (Transform.from_pil): the same uint8 images as cropping the whole image's tensor, for every colour mode and
    both splits' geometry."""
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    for train in (True, False):
        transform = Transform(ImageDataConfig(hflip=0.5), 24, train=train)
        for i, (h, w) in enumerate([(40, 56), (64, 37), (30, 30), (120, 80), (25, 90)]):
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
            whole = v2.functional.pil_to_tensor(img.convert("RGB"))
            expected = transform.apply(whole, transform.draw(h, w, torch.Generator().manual_seed(i)))
            image = transform.from_pil(img, torch.Generator().manual_seed(i))
            assert image.dtype == torch.uint8 and torch.equal(image, expected), (mode, train, h, w)


def test_worker_images_are_normalized_where_the_batch_trains():
    """Loader workers hand over uint8 pixels; the recipe's to_device makes (x / 255 - mean) / std of them, and
    leaves floats (synthetic images) as they are. Mixup/CutMix mixes floats: all its samples are normalized."""
    from torch.utils.data import default_collate

    from recipes.vit.recipe import ViTRecipe
    from tests.support.helpers import validated_config

    digits = ["data=imagefolder", f"data.root={REPO / 'data' / 'digits'}", "data.num_classes=10", "data.num_workers=0"]
    recipe = ViTRecipe(validated_config("vit_sanity", digits + ["checkpoint.path=unused"]))
    samples = [recipe.build_datasets().val[i] for i in range(4)]
    batch = recipe.to_device(default_collate(samples), torch.device("cpu"))
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (recipe.cfg.data.mean, recipe.cfg.data.std))
    expected = torch.stack([(s["image"].float() / 255 - mean) / std for s in samples])
    assert batch["image"].dtype == torch.float32 and torch.allclose(batch["image"], expected, atol=1e-6)
    synthetic = SyntheticImages(4, 8, 3, 10, seed=0)
    floats = default_collate([synthetic[i] for i in range(4)])
    assert torch.equal(recipe.to_device(dict(floats), torch.device("cpu"))["image"], floats["image"])

    data = ImageDataConfig(
        format="imagefolder",
        root=str(REPO / "data" / "digits"),
        num_classes=10,
        mixup_alpha=0.8,
        mix_prob=0.5,
        num_workers=0,
    )
    mixed = build_image_datasets(data, ViTModelConfig(img_size=28, patch_size=4, num_classes=10), seed=0)[0]
    assert {mixed[i]["image"].dtype for i in range(8)} == {torch.float32}  # mixed and unmixed alike


def test_class_count_mismatch_is_an_error():
    data = ImageDataConfig(format="imagefolder", root=str(REPO / "data" / "digits"), num_classes=10)
    with pytest.raises(ValueError, match="num_classes=7"):
        build_image_datasets(data, ViTModelConfig(img_size=28, patch_size=4, num_classes=7), seed=0)


def test_synthetic_images_are_deterministic():
    ds = SyntheticImages(100, 16, 3, 10, seed=1)
    a, b = ds[5], ds[5]
    assert torch.equal(a["image"], b["image"]) and a["label"] == b["label"]
    assert not torch.equal(ds[6]["image"], a["image"])


def test_prefetch_takes_exactly_the_batches_the_run_needs():
    """Batches are fetched ahead on a thread, but never past `count`: the training stream ends there (an
    IndexError beyond it), so the last step must not ask for more."""
    from core.data.loading import prefetch_to_device

    def stream(n):
        for i in range(n):
            yield {"x": torch.full((2,), float(i))}
        raise AssertionError("asked for a batch past the end")

    got = list(prefetch_to_device(stream(5), torch.device("cpu"), 5))
    assert [int(b["x"][0]) for b in got] == [0, 1, 2, 3, 4]
    assert list(prefetch_to_device(stream(5), torch.device("cpu"), 0)) == []
    it = prefetch_to_device(iter([{"x": torch.ones(1)}] * 3), torch.device("cpu"), 10)
    assert len(list(it)) == 3  # a shorter source simply ends


def test_prefetch_runs_ahead_on_threads_in_order_and_reports_errors_at_their_batch():
    """The move runs on other threads, at most threads + depth batches ahead of the consumer; with several
    threads and moves of uneven length the batches still come in order; a failing move is raised to the
    consumer when it reaches that batch (after the good ones before it); a consumer that stops early stops
    the threads."""
    import random
    import threading
    import time

    from core.data.loading import prefetch_to_device

    moved_on, taken = [], []

    def source(n):
        for i in range(n):
            taken.append(i)
            yield i

    def move(batch, device):
        moved_on.append(threading.current_thread().name)
        if batch == 4:
            raise ValueError("cannot decode the image number 4")
        return batch

    it = prefetch_to_device(source(10), torch.device("cpu"), 10, move, threads=1, depth=2)
    assert next(it) == 0
    time.sleep(0.3)
    assert len(taken) <= 1 + 1 + 2  # the one handed out, the thread's one, two ahead
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="number 4"):
        next(it)
    assert set(moved_on) == {"prefetch_to_device_0"}

    rng = random.Random(0)

    def slow(batch, device):
        moved_on.append(threading.current_thread().name)
        time.sleep(rng.random() * 0.02)
        return batch

    moved_on.clear()
    assert list(prefetch_to_device(source(40), torch.device("cpu"), 30, slow, threads=3)) == list(range(30))
    assert len(set(moved_on)) == 3  # the work was shared
    taken.clear()
    stopped = prefetch_to_device(source(1000), torch.device("cpu"), 1000, slow, threads=3, depth=2)
    assert next(stopped) == 0
    stopped.close()  # the loop ends early (a stop signal, an error): the threads end too
    time.sleep(0.3)
    assert len(taken) <= 1 + 3 + 2
    assert not any(t.name.startswith("prefetch_to_device") for t in threading.enumerate())
