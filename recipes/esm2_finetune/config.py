"""Schemas of the ESM-2 fine-tuning recipe's `model` (backbone + task head) and `data` (labelled files) groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING

from core.config.errors import require
from core.config.ranges import INT32_MAX, Int, Numbers, Real, Rule
from core.config.schema import DataConfig
from recipes.esm2.config import ESM2ModelConfig


class Task(StrEnum):
    regression = "regression"  # one or several numbers per sequence (mean squared error on standardised targets)
    classification = "classification"  # one class per sequence (softmax cross-entropy; binary = 2 classes)
    multilabel = "multilabel"  # several yes/no labels per sequence (sigmoid binary cross-entropy each)
    residue_classification = "residue_classification"  # one class per residue (cross-entropy over labelled ones)


class Pooling(StrEnum):
    mean = "mean"  # the mean final hidden state over the sequence's residues (not <cls>, <eos> or padding)
    cls = "cls"  # the <cls> token's final hidden state (Hugging Face's EsmForSequenceClassification)


SEQUENCE_TASKS = (Task.regression, Task.classification, Task.multilabel)


@dataclass
class ESM2TaskModelConfig(ESM2ModelConfig):
    task: Task = Task.regression
    pooling: Pooling = Pooling.mean  # sequence tasks: what the head sees of a sequence
    head_dropout: float = 0.1  # before each of the head's linear layers, in training
    # Class names in index order (regression: the targets; multilabel: the labels); null: the sorted distinct labels
    # of the training file (regression and multilabel: data.label_columns), written here by the recipe so that every
    # step folder's config.yaml keeps them and predictions print them.
    classes: Optional[list[str]] = None
    # One weight per class (classification and residues: the cross-entropy's; multilabel: each label's positive
    # weight); null: all 1.
    class_weights: Optional[list[float]] = None
    # Regression: the loss is on (target - mean) / std; predictions are out * std + mean. Null: the training
    # targets' mean and standard deviation, written here by the recipe.
    target_mean: Optional[list[float]] = None
    target_std: Optional[list[float]] = None

    RANGES: ClassVar[dict[str, Rule]] = {
        **ESM2ModelConfig.RANGES,
        "head_dropout": Real(0, 1, open_high=True),
        "class_weights": Numbers(Real(0, 1e9, open_low=True)),
        "target_mean": Numbers(Real(-1e30, 1e30)),
        "target_std": Numbers(Real(0, 1e30, open_low=True)),
    }

    @staticmethod
    def check(c, key: str) -> None:
        ESM2ModelConfig.check(c, key)
        classes = c.classes
        require(
            classes is None or (len(classes) >= 1 and len(set(classes)) == len(classes)),
            f"{key}.classes={classes}: expected distinct names",
        )
        if c.task in (Task.classification, Task.residue_classification) and classes is not None:
            require(len(classes) >= 2, f"{key}.classes={list(classes)}: a classification needs 2 or more classes")
        for name in ("class_weights", "target_mean", "target_std"):
            values = getattr(c, name)
            require(
                values is None or classes is None or len(values) == len(classes),
                f"{key}.{name}={None if values is None else list(values)}: expected one per class of "
                f"{key}.classes={None if classes is None else list(classes)}",
            )
        require(
            (c.target_mean is None) == (c.target_std is None),
            f"{key}.target_mean and {key}.target_std: give both or neither (null: the training targets')",
        )


@dataclass
class ESM2LabelledDataConfig(DataConfig):
    # Labelled sequences: .csv .tsv .parquet .jsonl (JSON Lines; .json read the same way), one row per sequence.
    train_path: str = MISSING
    val_path: Optional[str] = None  # null: no validation (or the split column's val rows)
    test_path: Optional[str] = None  # predict.py's test split
    # A column of train / val (valid, validation) / test: train_path then holds every split (val_path and
    # test_path null).
    split_column: Optional[str] = None
    sequence_column: str = "sequence"
    id_column: str = "id"  # a file without it: row numbers as ids
    # The label columns: regression, one per target; classification and residue_classification, one (a residue
    # column holds a string of one-letter labels "HHEEC", names separated by spaces, or a list); multilabel, one
    # per label, each 0/1 or true/false.
    label_columns: list[str] = field(default_factory=lambda: MISSING)
    # Packed: rows of tokens_per_pack tokens holding as many whole (cropped) sequences as fit, at most
    # max_sequences_per_pack; padded: one sequence per row of model.max_seq_length tokens.
    packing: bool = True
    tokens_per_pack: int = 8192
    max_sequences_per_pack: int = 64
    num_workers: int = 2

    RANGES: ClassVar[dict[str, Rule]] = {
        "tokens_per_pack": Int(3, INT32_MAX),
        "max_sequences_per_pack": Int(1, INT32_MAX),
    }

    @staticmethod
    def check(c, key: str) -> None:
        require(len(c.label_columns) >= 1, f"{key}.label_columns=[]: name the column(s) that hold the labels")
        require(
            len(set(c.label_columns)) == len(c.label_columns),
            f"{key}.label_columns={list(c.label_columns)}: a column named twice",
        )
        require(
            c.split_column is None or (c.val_path is None and c.test_path is None),
            f"{key}.split_column={c.split_column}: {key}.train_path holds every split; set {key}.val_path and "
            f"{key}.test_path to null",
        )
