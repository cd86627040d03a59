"""Schemas of the MNIST recipe's `model` and `data` config groups."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING

from core.config.ranges import INT32_MAX, Int, Rule
from core.config.schema import DataConfig, ModelConfig


class MNISTTask(StrEnum):
    autoencoder = "autoencoder"  # trunk + decoder, MSE reconstruction (pretraining)
    classifier = "classifier"  # trunk + digit_classifier, cross-entropy (fine-tuning)


@dataclass
class MNISTModelConfig(ModelConfig):
    task: MNISTTask = MISSING
    image_size: int = 28  # images are image_size x image_size, one channel
    hidden_size: int = 64  # trunk: pixels -> hidden -> ReLU -> latent; decoder mirrors it
    latent_size: int = 3
    num_classes: int = 10

    RANGES: ClassVar[dict[str, Rule]] = {
        "image_size": Int(1, INT32_MAX),
        "hidden_size": Int(1, INT32_MAX),
        "latent_size": Int(1, INT32_MAX),
        "num_classes": Int(1, INT32_MAX),
    }


@dataclass
class MNISTDataConfig(DataConfig):
    # torchvision's MNIST layout: <root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
    root: str = MISSING
    download: bool = False  # fetch the real MNIST into root when it is not there (needs network)
    # Samples of the training file held out for validation, by a fixed generator (split_seed);
    # null: 1/12 of them (MNIST's 60,000 -> 55,000 train + 5,000 validation).
    val_size: Optional[int] = None
    split_seed: int = 42
    # Validation and test sets are read in an order shuffled by PRNGResampleDataset from their own seeds
    # (the training stream is reshuffled every epoch by the loop, from the top-level `seed`).
    val_seed: int = 44
    test_seed: int = 45
    num_workers: int = 0  # the images are decoded once into memory; workers rarely help

    RANGES: ClassVar[dict[str, Rule]] = {
        # An empty validation set cannot be evaluated; the upper end is the training file's size, checked
        # when it is read (recipes/mnist/data.py).
        "val_size": Int(1, INT32_MAX, note="null: 1/12 of the training file"),
        "split_seed": Int(0, INT32_MAX),
        "val_seed": Int(0, INT32_MAX),
        "test_seed": Int(0, INT32_MAX),
    }
