"""Megatron-compatible dataset utilities and the determinism checker."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from core.data.checks import assert_dataset_compatible_with_megatron, assert_dataset_deterministic
from core.data.datasets import (
    EpochIndex,
    IdentityMultiEpochDatasetWrapper,
    MultiEpochDatasetResampler,
    PRNGResampleDataset,
    sample_generator,
)
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import build_image_datasets
from tests.support.helpers import REPO


class Recorder(Dataset):
    """Returns what it was asked for."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index


def test_each_epoch_holds_every_index_once_reshuffled_reproducibly():
    stream = MultiEpochDatasetResampler(Recorder(10), num_epochs=3, seed=5)
    assert len(stream) == 30
    items = [stream[i] for i in range(30)]
    assert all(isinstance(x, EpochIndex) for x in items)
    epochs = [[x.idx for x in items if x.epoch == e] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = MultiEpochDatasetResampler(Recorder(10), num_samples=25, seed=5)
    assert [again[i] for i in range(25)] == items[:25]  # reproducible, also read in any order
    assert [again[i] for i in reversed(range(25))] == items[:25][::-1]
    assert [MultiEpochDatasetResampler(Recorder(10), seed=6)[i] for i in range(10)] != items[:10]
    plain = MultiEpochDatasetResampler(Recorder(4), num_epochs=2, shuffle=False)
    assert [plain[i] for i in range(8)] == [EpochIndex(e, i) for e in range(2) for i in range(4)]
    with pytest.raises(IndexError):
        stream[30]
    with pytest.raises(ValueError):
        MultiEpochDatasetResampler(Recorder(3), num_epochs=1, num_samples=3)


def test_wrappers_compose():
    base = list(range(100, 110))  # an int-indexed "dataset"
    stream = MultiEpochDatasetResampler(
        PRNGResampleDataset(IdentityMultiEpochDatasetWrapper(base), seed=3, num_samples=6), num_epochs=2, seed=1
    )
    values = [stream[i] for i in range(12)]
    assert sorted(values[:6]) == sorted(values[6:]) and all(100 <= v < 110 for v in values)
    prng = PRNGResampleDataset(base, seed=3, num_samples=50)
    ids = [prng.source_index(i) for i in range(50)]
    assert ids == [PRNGResampleDataset(base, seed=3, num_samples=50).source_index(i) for i in range(50)]
    assert len(set(ids)) > 5 and ids != sorted(ids)  # pseudo-random, with replacement
    assert [prng[i] for i in range(5)] == [base[j] for j in ids[:5]]
    assert ids != [PRNGResampleDataset(base, seed=4, num_samples=50).source_index(i) for i in range(50)]
    assert_dataset_deterministic(stream)


def test_prng_resample_without_replacement_is_a_seeded_shuffle():
    base = list(range(7))
    prng = PRNGResampleDataset(base, seed=11, num_samples=21, replacement=False)
    ids = [prng[i] for i in range(21)]
    blocks = [ids[k * 7 : (k + 1) * 7] for k in range(3)]
    assert all(sorted(b) == base for b in blocks) and blocks[0] != blocks[1]  # every sample once per 7 ids
    assert ids == [PRNGResampleDataset(base, seed=11, num_samples=21, replacement=False)[i] for i in (range(21))]
    assert blocks[0] != [PRNGResampleDataset(base, seed=12, replacement=False)[i] for i in range(7)]
    assert [prng[i] for i in (20, 3, 9)] == [ids[20], ids[3], ids[9]]  # any order, no state


def test_sample_generator_depends_on_seed_epoch_and_index():
    draw = lambda *key: torch.rand(4, generator=sample_generator(*key))  # noqa: E731
    assert torch.equal(draw(1, 0, 5), draw(1, 0, 5))
    assert not torch.equal(draw(1, 0, 5), draw(1, 1, 5))
    assert not torch.equal(draw(1, 0, 5), draw(1, 0, 6))
    assert not torch.equal(draw(1, 0, 5), draw(2, 0, 5))


class SeedsGlobally(Recorder):
    def __getitem__(self, index):
        torch.manual_seed(index)
        return torch.rand(3)


class UsesPythonRandom(Recorder):
    def __getitem__(self, index):
        return {"x": index, "noise": random.random()}


class Flaky(Recorder):
    def __init__(self, n):
        super().__init__(n)
        self.calls = 0

    def __getitem__(self, index):
        self.calls += 1
        return {"image": torch.zeros(2), "meta": [1, np.array([self.calls % 2])]}


class Correct(Recorder):
    def __getitem__(self, index):
        g = sample_generator(0, 0, index)
        return {"image": torch.rand(2, generator=g), "label": index % 3, "extra": np.arange(3)}


def test_checker_catches_global_rng_use_and_nondeterminism():
    with pytest.raises(AssertionError, match=r"dataset\[0\] changed the global torch RNG"):
        assert_dataset_deterministic(SeedsGlobally(4))
    with pytest.raises(AssertionError, match=r"dataset\[0\] changed the global python RNG"):
        assert_dataset_deterministic(UsesPythonRandom(4))
    with pytest.raises(AssertionError, match=r"dataset\[2\] differs between two calls at sample\['meta'\]\[1\]"):
        assert_dataset_deterministic(Flaky(4), indices=[2])
    assert_dataset_deterministic(Correct(50))
    assert_dataset_compatible_with_megatron(Correct(50), indices=[1, 7])


def test_vit_datasets_are_deterministic_and_augment_per_epoch():
    data = ImageDataConfig(format="imagefolder", root=str(REPO / "data" / "digits"), num_classes=10, num_workers=0)
    train, val = build_image_datasets(data, ViTModelConfig(img_size=28, patch_size=7, num_classes=10), seed=0)
    assert_dataset_deterministic(train, indices=[EpochIndex(0, 3), EpochIndex(1, 3), EpochIndex(5, 1000)])
    assert_dataset_deterministic(val)
    assert_dataset_deterministic(MultiEpochDatasetResampler(train, num_epochs=2, seed=0))
    a, b = train[EpochIndex(0, 3)], train[EpochIndex(1, 3)]
    assert a["idx"] == b["idx"] == 3 and a["label"] == b["label"]
    assert not torch.equal(a["image"], b["image"])  # another crop/flip in another epoch
    synthetic = ImageDataConfig(format="synthetic", num_classes=10, synthetic_train_size=20, synthetic_val_size=4)
    for ds in build_image_datasets(synthetic, ViTModelConfig(img_size=16, patch_size=4, num_classes=10), seed=0):
        assert_dataset_deterministic(ds)


class Flat(Dataset):
    """Image of sample i: every pixel i; label i % 10."""

    def __len__(self):
        return 50

    def __getitem__(self, index):
        idx = index.idx if isinstance(index, EpochIndex) else index
        return {"image": torch.full((3, 8, 8), float(idx)), "label": idx % 10, "idx": idx}


def test_mixup_and_cutmix_are_per_sample_deterministic_and_mix_labels_as_images():
    from recipes.vit.data import MixupCutmix

    mixup = MixupCutmix(Flat(), 10, mixup_alpha=0.4, cutmix_alpha=0.0, prob=1.0, switch_prob=0.5, seed=0)
    cutmix = MixupCutmix(Flat(), 10, mixup_alpha=0.0, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, seed=0)
    checked = 0
    for idx in range(50):
        m, c = mixup[EpochIndex(0, idx)], cutmix[EpochIndex(0, idx)]
        for sample in (m, c):
            assert (
                sample["idx"] == idx and sample["label"] == idx % 10 and abs(float(sample["target"].sum()) - 1) < 1e-6
            )
        values = m["image"].unique()
        assert len(values) == 1  # blended everywhere: lam * idx + (1 - lam) * partner
        other = [k for k in range(10) if k != idx % 10 and m["target"][k] > 0]
        if other:  # the partner has another label: its weight is 1 - lam, so the partner index follows
            lam = float(m["target"][idx % 10])
            partner = round((float(values[0]) - lam * idx) / (1 - lam))
            assert abs(lam * idx + (1 - lam) * partner - float(values[0])) < 1e-4 and partner % 10 == other[0]
            checked += 1
        kept = (c["image"] == idx).float().mean().item()  # cutmix: a box of the partner, the rest kept
        pixels = c["image"].unique().tolist()
        if len(pixels) == 2 and c["target"][idx % 10] < 1:
            partner = int([p for p in pixels if p != idx][0])
            if partner % 10 != idx % 10:
                assert (
                    abs(float(c["target"][idx % 10]) - kept) < 1e-6
                    and abs(float(c["target"][partner % 10]) - (1 - kept)) < 1e-6
                )
                checked += 1
    assert checked > 40
    assert not torch.equal(mixup[EpochIndex(0, 3)]["image"], mixup[EpochIndex(1, 3)]["image"])  # redrawn per epoch
    assert not mixup[EpochIndex(0, 3)]["image"].equal(
        MixupCutmix(Flat(), 10, 0.4, 0.0, 1.0, 0.5, seed=1)[EpochIndex(0, 3)]["image"]
    )  # and per seed
    none = MixupCutmix(Flat(), 10, 0.4, 1.0, prob=0.0, switch_prob=0.5, seed=0)[EpochIndex(0, 7)]
    assert torch.equal(none["image"], torch.full((3, 8, 8), 7.0)) and none["target"][7] == 1
    with pytest.raises(ValueError, match="mix_prob"):
        MixupCutmix(Flat(), 10, 0.2, 0.0, 1.5, 0.5, 0)

    # The ViT recipe's real pipeline with both on: deterministic (the checker), soft targets.
    model = ViTModelConfig(img_size=28, patch_size=7, num_classes=10)
    cfg = ImageDataConfig(
        format="imagefolder",
        root=str(REPO / "data" / "digits"),
        num_classes=10,
        num_workers=0,
        mixup_alpha=0.4,
        cutmix_alpha=1.0,
    )
    train, _ = build_image_datasets(cfg, model, seed=0)
    assert isinstance(train, MixupCutmix)
    assert_dataset_deterministic(train, indices=[EpochIndex(0, 3), EpochIndex(1, 3), EpochIndex(2, 500)])
