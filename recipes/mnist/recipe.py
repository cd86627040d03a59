"""The MNIST recipe (BioNeMo's tutorial workflow): pretrain an autoencoder, fine-tune a digit classifier
from its trunk, predict on the test set.

    torchrun --nproc-per-node 2 train.py --config-name mnist_pretrain
    torchrun --nproc-per-node 2 train.py --config-name mnist_finetune checkpoint.init_from=<pretrain step dir>
    torchrun --nproc-per-node 2 predict.py --config-name mnist_predict checkpoint.init_from=<finetune step dir>
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, linear_default_rule
from recipes.base import Datasets, Recipe
from recipes.mnist.config import MNISTDataConfig, MNISTModelConfig
from recipes.mnist.data import build_mnist_split
from recipes.mnist.model import MNISTModel


class MNISTRecipe(Recipe):
    name = "mnist"
    model_schema = MNISTModelConfig
    data_schema = MNISTDataConfig
    predict_config = "mnist_predict"
    tiny_configs = {"autoencoder": ("mnist_pretrain", ()), "classifier": ("mnist_finetune", ())}

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = MNISTModel(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, linear_default_rule(model))
        return model

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.Linear]  # each layer is gathered and freed on its own

    def build_datasets(self) -> Datasets:
        train = self.split("train")
        val = self.split("val")
        return Datasets(train, val if len(val) else None)

    def split(self, name: str) -> Dataset:
        return build_mnist_split(self.cfg.data, name, self.cfg.model.image_size, self.cfg.model.num_classes)

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per sample: the autoencoder's mean squared error over the pixels, or the classifier's
        cross-entropy (and in evaluation whether its top guess is right)."""
        images, labels = batch["data"], batch["label"]
        out = model(images)
        if self.cfg.model.task == "autoencoder":
            loss = (out["reconstruction"].float() - images.flatten(1)).square().mean(dim=1)
            return {"loss": loss, "count": torch.ones_like(loss)}
        logits = out["logits"].float()
        result = {
            "loss": F.cross_entropy(logits, labels, reduction="none"),
            "count": torch.ones_like(labels, dtype=torch.float32),
        }
        if not training:
            result["accuracy"] = (logits.argmax(dim=-1) == labels).float()
        return result

    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss",) if self.cfg.model.task == "autoencoder" else ("loss", "accuracy")

    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per-sample output columns: the classifier's predicted digit and logits, or the autoencoder's
        reconstruction error; the latent code for both."""
        images = batch["data"]
        out = model(images)
        columns = {"idx": batch["idx"], "label": batch["label"]}
        if self.cfg.model.task == "classifier":
            logits = out["logits"].float()
            columns |= {"prediction": logits.argmax(dim=-1), "logits": logits}
        else:
            columns["mse"] = (out["reconstruction"].float() - images.flatten(1)).square().mean(dim=1)
        columns["latent"] = out["latent"].float()
        return columns

    def summarize_predictions(self, columns: dict[str, torch.Tensor]) -> dict[str, float]:
        if "prediction" in columns:
            return {"accuracy": (columns["prediction"] == columns["label"]).double().mean().item()}
        return {"mse": columns["mse"].double().mean().item()}

    def tokens_per_sample(self) -> int:
        return 1

    def flops_per_sample(self) -> float:
        """3 x the forward matmul FLOPs (2 per multiply-add) of one image."""
        model_cfg = self.cfg.model
        pixels = model_cfg.image_size * model_cfg.image_size
        trunk = pixels * model_cfg.hidden_size + model_cfg.hidden_size * model_cfg.latent_size
        head = (
            model_cfg.latent_size * model_cfg.hidden_size + model_cfg.hidden_size * pixels
            if model_cfg.task == "autoencoder"
            else model_cfg.latent_size * model_cfg.num_classes
        )
        return 3.0 * 2 * (trunk + head)


RECIPE = MNISTRecipe
