"""The ESM-2 fine-tuning recipe: ESM-2 with a task head on labelled sequences (regression, classification,
multilabel, per-residue classification), packed like pretraining.

torchrun --nproc-per-node 2 train.py --config-name esm2_finetune_sanity        # the shipped sanity task, on CPUs
torchrun --nproc-per-node 8 train.py --config-name esm2_finetune checkpoint.init_from=<HF ESM-2 folder> \\
    data.train_path=train.csv data.val_path=val.csv data.label_columns=[activity] model.task=regression
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from core.config.errors import ConfigError, DataError
from core.config.schema import FinetuneMode
from core.data.datasets import mix_seed
from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, standard_rule
from core.metrics.task_metrics import task_metric_names
from core.training.finetune import in_head
from core.training.memory_plan import BlockShape
from recipes.base import Datasets, Recipe
from recipes.esm2.recipe import ESM2Recipe
from recipes.esm2_finetune import predictions
from recipes.esm2_finetune.config import SEQUENCE_TASKS, ESM2LabelledDataConfig, ESM2TaskModelConfig, Task
from recipes.esm2_finetune.data import LabelledPacks, TargetCoding
from recipes.esm2_finetune.labels import LabelledSequences, LabelSpec, read_labelled
from recipes.esm2_finetune.model import ESM2TaskModel

log = logging.getLogger("train")
# FLOPs per backbone parameter per token, and per L H s^2 of attention per sequence, as finetune.mode trains
# (ESM2FinetuneRecipe.flop_counts).
COST = {FinetuneMode.full: (6, 12), FinetuneMode.frozen: (2, 4), FinetuneMode.lora: (4, 12)}
TINY = (
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
)


class ESM2FinetuneRecipe(Recipe):
    name = "esm2_finetune"
    model_schema = ESM2TaskModelConfig
    data_schema = ESM2LabelledDataConfig
    model_data_keys = ("label_columns",)  # what the head's outputs mean
    predict_config = "esm2_finetune_sanity"
    tiny_configs = {
        "": ("esm2_finetune_sanity", TINY),
        "residue": (
            "esm2_finetune_sanity",
            (*TINY, "model.task=residue_classification", "data.label_columns=[structure]"),
        ),
    }

    # --- config ------------------------------------------------------------------------------------
    @classmethod
    def resolve_config(cls, cfg, is_main: bool = True):
        """model.classes (null: the training file's sorted classes; regression and multilabel: data.label_columns)
        and, for regression, model.target_mean / target_std (null: the training targets')."""
        model, data = cfg.model, cfg.data
        task, columns = Task(model.task), list(data.label_columns)
        if task not in SEQUENCE_TASKS or task is Task.classification:
            if len(columns) != 1:
                raise ConfigError(f"data.label_columns={columns}: model.task={task} reads one label column")
        elif model.classes is not None and list(model.classes) != columns:
            raise ConfigError(
                f"model.classes={list(model.classes)}: model.task={task} names its outputs after "
                f"data.label_columns={columns} (or null)"
            )
        found = {}
        if model.classes is None or (task is Task.regression and model.target_mean is None):
            train = cls.training_labels(cfg)
            found["classes"] = list(train.classes)
            if task is Task.regression and model.target_mean is None:
                std = train.targets.std(axis=0)
                found["target_mean"] = [float(v) for v in train.targets.mean(axis=0)]
                found["target_std"] = [float(v) if v > 0 else 1.0 for v in std]  # a constant target: unscaled
            if is_main:
                log.info("%s", ", ".join(f"model.{k}={v}" for k, v in found.items()) + f" (from {train.source})")
        classes = found.get("classes", model.classes)
        weights = model.class_weights
        if weights is not None and len(weights) != len(classes):
            raise ConfigError(f"model.class_weights={list(weights)}: expected one per class of {list(classes)}")
        if not found:
            return cfg
        cfg = cfg.copy()
        OmegaConf.set_readonly(cfg, False)
        for key, value in found.items():
            cfg.model[key] = value
        OmegaConf.set_readonly(cfg, True)
        return cfg

    @classmethod
    def training_labels(cls, cfg) -> LabelledSequences:
        data = cfg.data
        spec = label_spec(cfg, classes=None, labels_required=True)
        found = read_labelled(data.train_path, "data.train_path", spec)
        train = found.get("train" if data.split_column else "all")
        if train is None:
            raise DataError(f"data.train_path={data.train_path}: no row of the train split ({data.split_column})")
        return train

    # --- model -------------------------------------------------------------------------------------
    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = ESM2TaskModel(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, standard_rule(self.cfg.model.init_std), layers.tp)
        return model

    def block_shape(self) -> BlockShape:
        m = self.cfg.model  # the task heads' outputs are per sequence or few per token: not counted
        return BlockShape(m.num_layers, m.hidden_size, m.ffn_hidden_size, m.hidden_size, gated=False)

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    # --- data --------------------------------------------------------------------------------------
    def pack_shape(self) -> tuple[int, int]:
        return ESM2Recipe.pack_shape(self)  # the same rows as pretraining (uses cfg.data and cfg.model only)

    def read_splits(self, names: tuple[str, ...], labels_required: bool = True) -> dict[str, LabelledSequences]:
        """The named splits' labelled sequences (each file read once); a split without a file is left out."""
        data, spec = self.cfg.data, label_spec(self.cfg, tuple(self.cfg.model.classes), labels_required)
        if data.split_column:
            found = read_labelled(data.train_path, "data.train_path", spec)
            return {name: found[name] for name in names if name in found}
        paths = {"train": data.train_path, "val": data.val_path, "test": data.test_path}
        return {
            name: read_labelled(paths[name], f"data.{name}_path", spec)["all"]
            for name in names
            if paths[name] is not None
        }

    def packs(self, sequences: LabelledSequences, training: bool) -> LabelledPacks:
        budget, max_sequences = self.pack_shape()
        m = self.cfg.model
        coding = TargetCoding(
            Task(m.task),
            len(m.classes),
            None if m.target_mean is None else np.asarray(m.target_mean, dtype=np.float64),
            None if m.target_std is None else np.asarray(m.target_std, dtype=np.float64),
            None if m.class_weights is None else np.asarray(m.class_weights, dtype=np.float32),
        )
        shuffle = mix_seed(self.cfg.seed, 0x9AC) if training else None
        return LabelledPacks(
            sequences,
            np.arange(len(sequences)),
            budget,
            m.max_seq_length,
            max_sequences,
            coding,
            self.cfg.seed,
            shuffle,
            random_crop=training,
        )

    def build_datasets(self) -> Datasets:
        """Packs of the training sequences (planned once, from the seed) and of the validation ones (in file order).
        Every given file (test too) is read and checked first."""
        splits = self.read_splits(("train", "val", "test"))
        if "train" not in splits:
            raise DataError(f"data.train_path={self.cfg.data.train_path}: no row of the train split")
        val = splits.get("val")
        return Datasets(self.packs(splits["train"], training=True), None if val is None else self.packs(val, False))

    # --- task --------------------------------------------------------------------------------------
    def loss_count(self, batch: dict) -> torch.Tensor:
        if Task(self.cfg.model.task) is Task.residue_classification:
            return (batch["labels"] >= 0).sum()
        return (batch["sequences"] >= 0).sum()

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per row: the sum of its items' losses (sequences; labelled residues) and their number. An item's loss
        is its class weight x its cross-entropy (multilabel: the mean over labels of the weighted binary
        cross-entropy; regression: the mean squared error over targets, standardised). In validation, "items":
        each item's row, output (regression: standardised prediction; else probabilities) and target."""
        logits = model(batch["tokens"], batch["cu_seqlens"]).float()
        task, weights = Task(self.cfg.model.task), batch["weights"]
        if task is Task.residue_classification:
            target, valid = batch["labels"], batch["labels"] >= 0
            per_item = F.cross_entropy(logits.flatten(0, 1), target.clamp(min=0).flatten(), reduction="none")
            per_item = per_item.view(target.shape) * weights
        else:
            valid, target = batch["sequences"] >= 0, batch["targets"]
            logits = logits[:, : valid.shape[1]]
            if task is Task.classification:
                per_item = F.cross_entropy(logits.flatten(0, 1), target.clamp(min=0).flatten(), reduction="none")
                per_item = per_item.view(target.shape) * weights
            elif task is Task.multilabel:
                per_item = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * weights).mean(-1)
            else:
                per_item = ((logits - target).square() * weights).mean(-1)
        out = {"loss": (per_item * valid).sum(dim=1), "count": valid.sum(dim=1).to(per_item.dtype)}
        if not training:
            out["items"] = task_items(task, logits, target, valid)
        return out

    def validation_metrics(self) -> tuple[str, ...]:
        m = self.cfg.model
        return ("loss", *task_metric_names(str(Task(m.task)), len(m.classes)))

    def summarize_items(self, items: dict[str, torch.Tensor]) -> dict[str, float]:
        return predictions.task_metrics(self.cfg.model, items["output"], items["target"])

    # --- prediction (predict.py) -------------------------------------------------------------------
    def default_split(self) -> str:
        data = self.cfg.data
        return "test" if data.test_path is not None or data.split_column else "val"

    def split(self, name: str) -> LabelledPacks:
        """The train, val or test split's sequences (their labels, where the file has them, for the metrics)."""
        if name not in ("train", "val", "test"):
            raise ConfigError(f"predict.split={name}: the {self.name} recipe's splits are train, val and test")
        found = self.read_splits((name,), labels_required=False)
        if name not in found:
            key = "data.split_column" if self.cfg.data.split_column else f"data.{name}_path"
            raise ConfigError(f"predict.split={name}: no {name} split ({key} gives none)")
        return self.packs(found[name], training=False)

    def unlabeled(self, folder: str) -> LabelledPacks:
        """predict.folder: a file of sequences in any format data.train_path takes (its labels, if any, are read)."""
        spec = label_spec(self.cfg, tuple(self.cfg.model.classes), labels_required=False, split_column=False)
        return self.packs(read_labelled(folder, "predict.folder", spec)["all"], training=False)

    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        return predictions.predict(self.cfg, model, batch)

    def finish_predictions(self, packs: LabelledPacks, columns: dict[str, torch.Tensor]) -> dict:
        return predictions.finish(self.cfg.model, packs, columns)

    def summarize_predictions(self, columns: dict) -> dict[str, float | int]:
        return predictions.summarize(self.cfg.model, columns)

    # --- accounting --------------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        return self.pack_shape()[0]

    def work(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's real tokens and their training FLOPs, as finetune.mode trains (flop_counts)."""
        sequences = batch["sequences"]
        lengths = batch["cu_seqlens"].diff(dim=1)[:, : sequences.shape[1]].double() * (sequences >= 0)
        per_token, per_square, per_sequence = self.flop_counts()
        flops = per_token * lengths.sum() + per_square * lengths.square().sum() + per_sequence * (sequences >= 0).sum()
        return lengths.sum(), flops

    def flops_per_sample(self) -> float:
        """Training FLOPs of one full row of sequences of model.max_seq_length tokens."""
        tokens, s = self.tokens_per_sample(), self.cfg.model.max_seq_length
        per_token, per_square, per_sequence = self.flop_counts()
        return tokens * (per_token + per_square * s) + per_sequence * tokens / s

    def flop_counts(self) -> tuple[float, float, float]:
        """A training step's FLOPs (per token, per squared sequence length, per sequence) as finetune.mode trains.
        A weight's matmul costs 2 FLOPs per parameter forward, 2 for the input's gradient, 2 for its own: full
        fine-tuning 6 N per token and the attention's 12 L H s^2 per sequence (forward 4 L H s^2); a frozen backbone
        only its forward (2 N, 4 L H s^2: no backward through it); LoRA the backbone's forward and input gradients but
        no weight gradients (4 N; the attention, which has no weights, 12 L H s^2) plus 6 per adapter parameter. The
        head's modules under finetune.head train in every mode (6 per parameter); one it leaves out counts as the
        backbone does."""
        m, ft = self.cfg.model, self.cfg.finetune
        mode = FinetuneMode(ft.mode)
        backbone, attention = COST[mode]
        head = [0.0, 0.0]  # per token, per sequence
        for name, (out, on_tokens) in self.head_modules().items():
            trains = mode is FinetuneMode.full or in_head(f"head.{name}", list(ft.head))
            head[0 if on_tokens else 1] += out * (m.hidden_size + 1) * (6 if trains else backbone)
        adapter_token, adapter_sequence = self.adapter_parameters() if mode is FinetuneMode.lora else (0, 0)
        return (
            backbone * self.backbone_parameters() + head[0] + 6.0 * adapter_token,
            attention * m.num_layers * m.hidden_size,
            head[1] + 6.0 * adapter_sequence,
        )

    def backbone_parameters(self) -> int:
        """Parameters a token's forward multiplies through in the backbone: the blocks and the final norm."""
        m = self.cfg.model
        h, f = m.hidden_size, m.ffn_hidden_size
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # QKV + proj (with biases), fc1 + fc2, two LayerNorms
        return m.num_layers * block + 2 * h

    def head_modules(self) -> dict[str, tuple[int, bool]]:
        """The head's Linear layers, each taking the hidden size: {name: (outputs, whether it runs on every token)}:
        the residue head's out_proj on every token, the sequence head's dense and out_proj on each pooled vector."""
        m = self.cfg.model
        h, k = m.hidden_size, len(m.classes)
        return {"dense": (h, False), "out_proj": (k, False)} if m.task in SEQUENCE_TASKS else {"out_proj": (k, True)}

    def adapter_parameters(self) -> tuple[int, int]:
        """LoRA's parameters (a token's, a sequence's): rank x (in + out) of each adapted module, as core/layers/lora.py
        adds them (finetune.lora.target_modules, outside finetune.head)."""
        m, ft = self.cfg.model, self.cfg.finetune
        h, layers, targets = m.hidden_size, m.num_layers, set(ft.lora.target_modules)
        blocks = {"layernorm_qkv": layers * (h + 3 * h), "proj": layers * (h + h)}  # [out, in] = [3h, h], [h, h]
        fans = [sum(size for name, size in blocks.items() if name in targets), 0]  # per token, per sequence
        for name, (out, on_tokens) in self.head_modules().items():
            if name in targets and not in_head(f"head.{name}", list(ft.head)):
                fans[0 if on_tokens else 1] += h + out
        return ft.lora.rank * fans[0], ft.lora.rank * fans[1]


def label_spec(cfg, classes, labels_required: bool, split_column: bool = True) -> LabelSpec:
    data = cfg.data
    return LabelSpec(
        Task(cfg.model.task),
        tuple(data.label_columns),
        classes,
        data.sequence_column,
        data.id_column,
        data.split_column if split_column else None,
        labels_required,
    )


def task_items(task: Task, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> dict:
    """Validation items: {"row": each item's row, "output": [N, K], "target": [N] or [N, K]} (on the device)."""
    rows = torch.arange(valid.shape[0], device=valid.device).view(-1, *([1] * (valid.dim() - 1))).expand_as(valid)
    if task is Task.regression:
        output = logits
    elif task is Task.multilabel:
        output = torch.sigmoid(logits)
    else:
        output = torch.softmax(logits, dim=-1)
    return {"row": rows[valid], "output": output[valid].detach(), "target": target[valid]}


RECIPE = ESM2FinetuneRecipe
