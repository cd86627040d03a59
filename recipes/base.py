"""What a recipe gives the training loop: a model, its data, and the task (loss and metrics).

The loop in train.py calls only these methods, so a new recipe is a new subclass plus config files;
the loop itself does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from core.config.errors import ConfigError
from core.data.loading import to_device
from core.layers.namespace import Layers


@dataclass
class Datasets:
    train: Dataset
    val: Optional[Dataset]


class Recipe:
    """Instantiated once per run with the validated config (`self.cfg`)."""

    name: str = ""
    model_schema: type = object  # dataclass for the `model` config group
    data_schema: type = object  # dataclass for the `data` config group
    # The `data` settings a trained model depends on (what turns an input into what it saw in training):
    # predict.py and generate.py take them, with the model's, from a step folder's config.yaml.
    model_data_keys: tuple[str, ...] = ()

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @classmethod
    def resolve_config(cls, cfg: Any, is_main: bool = True) -> Any:
        """The validated config with what the recipe reads from its data filled in (e.g. the ViT's class
        count for data.num_classes: null), before the recipe is made from it; a read-only config. A function
        of the config and the files it names: it keeps nothing (is_main: whether to log what it found)."""
        return cfg

    # --- model -------------------------------------------------------------------------------
    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        """Build the full (unsharded) model on `device`, weights initialised deterministically
        from cfg.seed (the same values on every rank and with either layer backend)."""
        raise NotImplementedError

    def unit_modules(self, layers: Layers) -> list[type]:
        """Module classes that FSDP shards, gathers and frees as one unit (the transformer block)."""
        raise NotImplementedError

    def no_weight_decay(self, model: nn.Module) -> set[str]:
        """Names of matrix-shaped parameters that take no weight decay (biases and norm weights,
        i.e. every parameter with fewer than 2 dimensions, never take it)."""
        return set()

    # --- data --------------------------------------------------------------------------------
    def build_datasets(self) -> Datasets:
        """Map-style datasets whose samples are dicts (the loop adds a "valid" flag in validation).

        The training set is indexed with core.data.datasets.EpochIndex(epoch, idx) (the loop wraps it in a
        MultiEpochDatasetResampler); draw random effects from sample_generator(seed, epoch, idx), never
        from the global RNGs. The validation set is indexed with ints. Both must pass
        core.data.checks.assert_dataset_deterministic."""
        raise NotImplementedError

    def default_split(self) -> str:
        """The split predict.py predicts on when predict.split is not given: "test" where the data has one, else
        "val" (recipes whose data may lack a test split say which it has)."""
        return "test"

    def split(self, name: str) -> Dataset:
        """One named split (e.g. "test") for predict.py, indexed with ints; it carries what finish_predictions
        needs to name its rows (the recipe keeps nothing between the calls)."""
        raise ConfigError(f"the {self.name} recipe has no split {name!r} for prediction")

    def unlabeled(self, folder: str) -> Dataset:
        """predict.folder: every input under `folder`, without labels, indexed with ints."""
        raise ConfigError(f"the {self.name} recipe does not predict on a folder (predict.folder)")

    def collate_fn(self):
        return None  # torch's default_collate

    def to_device(self, batch: dict, device: torch.device) -> dict:
        """A collated batch onto the training device (for training batches the loop calls it on background
        threads, each with its own CUDA stream: core/data/loading.py). Recipes that finish preprocessing on the
        device (decoding, augmentation) do it here."""
        return to_device(batch, device)

    def prefetch_threads(self) -> int:
        """How many training batches to_device works on at once (threads)."""
        return 1

    # --- task --------------------------------------------------------------------------------
    def loss_count(self, batch: dict) -> torch.Tensor:
        """Number of loss terms in a micro-batch (samples, or unmasked tokens), as a 0-d tensor.
        The loop sums it over the global batch first, so the loss is a true mean over it."""
        raise NotImplementedError

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per-sample values: "loss" (sum of the sample's loss terms) and "count" (their number);
        in evaluation, further metrics to be summed (e.g. "top1": 1.0 where correct)."""
        raise NotImplementedError

    def summarize_validation(self, means: dict[str, float]) -> dict[str, float]:
        """Turn per-term means of the validation sums into the reported metrics."""
        return means

    def validation_metrics(self) -> tuple[str, ...]:
        """The names of the metrics validation reports (summarize_validation's keys), known before any work so
        that checkpoint.monitor and training.objective.metric are checked at setup. Every forward gives "loss";
        a recipe with further metrics names them all."""
        return ("loss",)

    # --- prediction (predict.py) -----------------------------------------------------------
    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per-sample output columns, each [B] or [B, k] (k columns named <name>_0 .. <name>_{k-1});
        an "idx" column, when given, orders the output file."""
        raise NotImplementedError(f"the {self.name} recipe does not support predict.py")

    def finish_predictions(self, dataset: Dataset,
                           columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        """All ranks' rows, gathered on rank 0 in sample order, of `dataset` (what split() or unlabeled() gave)
        -> the columns written: may add text columns (a list per column, e.g. class names, read from the
        dataset) or combine rows (e.g. windows into documents)."""
        return columns

    def summarize_predictions(self, columns: dict[str, torch.Tensor | list]) -> dict[str, float]:
        """Whole-split metrics from the finished rows (e.g. accuracy)."""
        return {}

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        raise NotImplementedError

    def work(self, batch: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(real tokens, training FLOPs) of a training micro-batch, as 0-d device tensors, for recipes whose samples
        differ in content (packed sequences with padding); None: every sample counts tokens_per_sample tokens and
        flops_per_sample FLOPs."""
        return None

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward + backward) for one sample, for MFU."""
        raise NotImplementedError
