"""What a recipe gives the training loop: a model, its data, and the task (loss and metrics).

A recipe is a subclass of `Recipe` in recipes/<name>/recipe.py, exposed as `RECIPE`; the registry finds it there.
It must give four things (abstract below): `build_model`, `unit_modules`, `build_datasets` and `forward`.
Everything else has a default, or is an opt-in protocol that the tool needing it checks before any work:

    prediction (predict.py)        split + predict                  (PREDICTION)
    generation (generate.py)       tokenizer + vocab_size + new_kv_cache + next_logits (GENERATION)
    chat prompts (generate.py)     chat_prompt + end_of_turn_ids (CHAT)
    MFU and tokens/s in the log    tokens_per_sample, flops_per_sample, work (None: not reported)
    validation metrics             validation_metrics + summarize_validation (default: the loss)
    metrics over every item        forward's "items" in evaluation + summarize_items (default: none)
    Hugging Face conversion        recipes/<name>/hf.py with export_to_hf, import_from_hf and HF_MODEL_TYPES
    context parallelism            check_context_parallel + context_parallel_share (default: distributed.cp refused)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from core.config.errors import ConfigError
from core.config.schema import DataConfig, ModelConfig
from core.data.loading import to_device
from core.layers.context_parallel import ContextParallel
from core.layers.namespace import Layers
from core.training.memory_plan import BlockShape

# The opt-in protocols: the methods (or properties) a recipe defines to support a tool. The tool checks them with
# `require` before any work; their contracts are documented where the Recipe below lists them.
PREDICTION = ("split", "predict")
GENERATION = ("tokenizer", "vocab_size", "new_kv_cache", "next_logits")
CHAT = ("chat_prompt", "end_of_turn_ids")


@dataclass
class Datasets:
    train: Dataset
    val: Optional[Dataset]


class Recipe(ABC):
    """Instantiated once per run with the validated config (`self.cfg`)."""

    name: ClassVar[str] = ""  # `recipe: <name>` in a config; the folder recipes/<name>/
    # The schemas of the `model` and `data` config groups (recipes/<name>/config.py): dataclasses extending these,
    # with an optional RANGES table and `check` (core/config/ranges.py). The defaults: no settings of its own.
    model_schema: ClassVar[type] = ModelConfig
    data_schema: ClassVar[type] = DataConfig
    # The `data` settings a trained model depends on (what turns an input into what it saw in training):
    # predict.py and generate.py take them, with the model's, from a step folder's config.yaml.
    model_data_keys: ClassVar[tuple[str, ...]] = ()
    # The config (configs/<config>.yaml) predict.py and generate.py compose for a checkpoint of this recipe when
    # neither the command line nor the checkpoint names one; "": configs/<name>.yaml.
    predict_config: ClassVar[str] = ""
    # For the tests that sweep every recipe (tests/unit/config/test_monitored_metrics.py,
    # tests/unit/config/test_validation.py): {case: (config, overrides)} that build a model in a moment and read data
    # shipped in the repository ("{tmp}" in an override: a temporary folder). The default: configs/<name>.yaml as it is.
    tiny_configs: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {}

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @classmethod
    def resolve_config(cls, cfg: Any, is_main: bool = True) -> Any:
        """The validated config with what the recipe reads from its data filled in (e.g. the ViT's class
        count for data.num_classes: null), before the recipe is made from it; a read-only config. A function
        of the config and the files it names: it keeps nothing (is_main: whether to log what it found)."""
        return cfg

    @classmethod
    def test_configs(cls) -> dict[str, tuple[str, tuple[str, ...]]]:
        """`tiny_configs`, or {name: (name, ())}: the cases the all-recipe tests run, named "<recipe>[ <case>]"."""
        cases = cls.tiny_configs or {"": (cls.name, ())}
        return {f"{cls.name} {case}".strip(): (config, tuple(overrides)) for case, (config, overrides) in cases.items()}

    # --- model (required) ----------------------------------------------------------------------
    @abstractmethod
    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        """Build the full (unsharded) model on `device` from the `layers` namespace (TransformerEngine's layers or
        their torch twins: core/layers/namespace.py; plain torch.nn modules work too), weights initialised
        deterministically from cfg.seed (core.layers.weight_init.init_parameters: the same values on every rank
        and with either layer backend)."""

    @abstractmethod
    def unit_modules(self, layers: Layers) -> list[type]:
        """Module classes that FSDP shards, gathers and frees as one unit (the transformer block; for a small
        model, its linear layers)."""

    def block_shape(self) -> Optional[BlockShape]:
        """The transformer's shape for the memory plan (core/training/memory_plan.py); None: no plan (small models)."""
        return None

    def no_weight_decay(self, model: nn.Module) -> set[str]:
        """Names of matrix-shaped parameters that take no weight decay (biases and norm weights,
        i.e. every parameter with fewer than 2 dimensions, never take it)."""
        return set()

    # --- data (required: build_datasets) ---------------------------------------------------------
    @abstractmethod
    def build_datasets(self) -> Datasets:
        """Map-style datasets whose samples are dicts (the loop adds a "valid" flag in validation).

        The training set is indexed with core.data.datasets.EpochIndex(epoch, idx) (the loop wraps it in a
        MultiEpochDatasetResampler); draw random effects from sample_generator(seed, epoch, idx), never
        from the global RNGs. The validation set is indexed with ints. Both must pass
        core.data.checks.assert_dataset_deterministic."""

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

    def cuda_connections(self) -> Optional[int]:
        """The hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS) this run's GPU needs, or None: the driver's
        default. A to_device that queues GPU work of its own beside the step (ViT's JPEG decoding) needs more:
        streams beyond the queues share them, and its work then waits behind the step's queued kernels."""
        return None

    # --- context parallelism (distributed.cp > 1): optional ----------------------------------------
    def check_context_parallel(self, cp_size: int) -> None:
        """Refuse, before any work, a distributed.cp this recipe cannot split its samples over (ConfigError)."""
        raise ConfigError(
            f"distributed.cp={cp_size}: the {self.name} recipe does not split its samples over context-parallel "
            "ranks; use distributed.cp=1"
        )

    def context_parallel_share(self, batch: dict, cp: ContextParallel) -> dict:
        """This rank's share of a batch on the device: each sequence's tokens at the positions `cp` gives this rank
        (the model's attention then covers the whole group's). loss_count and forward count the share's terms; the
        loop sums them over the context-parallel ranks."""
        raise NotImplementedError(f"the {self.name} recipe has no context-parallel share of its batches")

    # --- task (required: forward) ----------------------------------------------------------------
    @abstractmethod
    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per-sample values: "loss" (sum of the sample's loss terms) and "count" (their number);
        in evaluation, further metrics to be summed (e.g. "top1": 1.0 where correct), and optionally "items":
        {"row": LongTensor [N], <name>: Tensor [N, ...]}, one entry per item of the micro-batch (a sample, a
        sequence of a packed row, a labelled residue; "row" = its row in the micro-batch) for summarize_items."""

    def loss_count(self, batch: dict) -> torch.Tensor:
        """Number of loss terms in a micro-batch, as a 0-d tensor on the batch's device: the sum of forward's
        "count", known before the forward. The loop sums it over the global batch first, so the loss is a true
        mean over it. The default: one term per sample (recipes with token losses count unmasked tokens)."""
        first = next(value for value in batch.values() if isinstance(value, torch.Tensor))
        return torch.full((), float(len(first)), device=first.device)  # no host-to-device copy

    def summarize_validation(self, means: dict[str, float]) -> dict[str, float]:
        """Turn per-term means of the validation sums into the reported metrics."""
        return means

    def summarize_items(self, items: dict[str, torch.Tensor]) -> dict[str, float]:
        """Figures over every validation item (e.g. Spearman, AUROC: core/metrics/task_metrics.py), for recipes whose
        forward returns "items" in evaluation: `items` holds each name's entries of every valid item of the whole
        validation set, gathered over the data-parallel ranks, on the CPU ("row" dropped). Called on every rank
        with the same items; its names join summarize_validation's (none in both)."""
        return {}

    def validation_metrics(self) -> tuple[str, ...]:
        """The names of the metrics validation reports (summarize_validation's and summarize_items' keys), known
        before any work so that checkpoint.monitor and training.objective.metric are checked at setup. Every forward
        gives "loss"; a recipe with further metrics names them all."""
        return ("loss",)

    # --- prediction (predict.py): opt in with split() and predict() --------------------------------
    # split(self, name: str) -> Dataset: one named split (e.g. "test") for predict.py, indexed with ints; it
    #     carries what finish_predictions needs to name its rows (the recipe keeps nothing between the calls).
    # predict(self, model, batch) -> dict[str, Tensor]: per-sample output columns, each [B] or [B, k] (k columns
    #     named <name>_0 .. <name>_{k-1}); an "idx" column, when given, orders the output file.
    def default_split(self) -> str:
        """The split predict.py predicts on when predict.split is not given: "test" where the data has one, else
        "val" (recipes whose data may lack a test split say which it has)."""
        return "test"

    def unlabeled(self, folder: str) -> Dataset:
        """predict.folder: every input under `folder`, without labels, indexed with ints."""
        raise ConfigError(f"the {self.name} recipe does not predict on a folder (predict.folder)")

    def finish_predictions(self, dataset: Dataset, columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list]:
        """All ranks' rows, gathered on rank 0 in sample order, of `dataset` (what split() or unlabeled() gave)
        -> the columns written: may add text columns (a list per column, e.g. class names, read from the
        dataset) or combine rows (e.g. windows into documents)."""
        return columns

    def summarize_predictions(self, columns: dict[str, torch.Tensor | list]) -> dict[str, float]:
        """Whole-split metrics from the finished rows (e.g. accuracy)."""
        return {}

    # --- generation (generate.py): opt in with tokenizer, vocab_size, new_kv_cache and next_logits ----
    # tokenizer: encode(text) -> ids, decode(ids) -> text, eod, vocab_size (its ids), pad (optional; never generated);
    # vocab_size: the model's vocabulary (its rows past the tokenizer's are never generated);
    # new_kv_cache(self, model, max_length, dtype): an empty key/value cache for one sequence of up to max_length
    #     tokens; next_logits(self, model, tokens, kv_cache) -> logits: tokens [1, n] -> logits [1, n, vocab], with a
    #     cache continuing the tokens it holds (None: the whole window). core/generation/decoding.py does the rest.

    # --- accounting (the throughput log): optional -------------------------------------------------
    def tokens_per_sample(self) -> Optional[int]:
        """Tokens of one sample, for tokens/s in the log; None: not reported."""
        return None

    def flops_per_sample(self) -> Optional[float]:
        """Training FLOPs (forward + backward) for one sample, for MFU; None: no MFU reported."""
        return None

    def work(self, batch: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(real tokens, training FLOPs) of a training micro-batch, as 0-d device tensors, for recipes whose samples
        differ in content (packed sequences with padding); None: every sample counts tokens_per_sample tokens and
        flops_per_sample FLOPs."""
        return None


def lacking(recipe: type[Recipe], protocol: tuple[str, ...]) -> list[str]:
    """The names of `protocol` (PREDICTION, GENERATION) the recipe class does not define."""
    return [name for name in protocol if getattr(recipe, name, None) is None]


def require(recipe: type[Recipe], protocol: tuple[str, ...], tool: str) -> None:
    """ConfigError, before any work, when the recipe does not support `tool` (it lacks part of `protocol`)."""
    missing = lacking(recipe, protocol)
    if missing:
        raise ConfigError(
            f"{tool} needs a recipe with {' and '.join(protocol)}; the {recipe.name} recipe has no "
            f"{' and no '.join(missing)} (recipes/base.py)"
        )
