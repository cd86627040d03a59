"""The ViT recipe: image classification with a Vision Transformer."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from core.layers.weight_init import init_parameters, standard_rule
from core.layers.namespace import Layers
from recipes.base import Datasets, Recipe
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import Transform, build_image_datasets, collate_encoded, decode_batch
from recipes.vit.model import VisionTransformer


class ViTRecipe(Recipe):
    name = "vit"
    model_schema = ViTModelConfig
    data_schema = ImageDataConfig

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = VisionTransformer(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, standard_rule(self.cfg.model.init_std))
        return model

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    def no_weight_decay(self, model: nn.Module) -> set[str]:
        return {"cls_token", "pos_embed"}

    def build_datasets(self) -> Datasets:
        return Datasets(*build_image_datasets(self.cfg.data, self.cfg.model, self.cfg.seed))

    def collate_fn(self):
        return collate_encoded if self.cfg.data.decode_on == "device" else None

    def to_device(self, batch: dict, device: torch.device) -> dict:
        if "jpeg" not in batch:
            return super().to_device(batch, device)
        # data.decode_on=device: decode and augment here (the crops were drawn by the loader workers).
        return decode_batch(batch, self._device_transform, device)

    @functools.cached_property
    def _device_transform(self) -> Transform:
        return Transform(self.cfg.data, self.cfg.model.img_size, train=True)  # the crops say train or val

    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), float(len(batch["label"])), device=batch["label"].device)  # no host-to-device copy

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        logits = model(batch["image"]).float()
        labels = batch["label"]
        smoothing = self.cfg.model.label_smoothing if training else 0.0
        # Mixup / CutMix samples carry a label distribution ("target") to train on instead.
        targets = batch["target"] if training and "target" in batch else labels
        out = {"loss": F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing),
               "count": torch.ones_like(labels, dtype=torch.float32)}
        if not training:
            top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            out["top1"] = (top5[:, 0] == labels).float()
            out["top5"] = (top5 == labels[:, None]).any(dim=-1).float()
        return out

    def tokens_per_sample(self) -> int:
        return (self.cfg.model.img_size // self.cfg.model.patch_size) ** 2 + 1

    def flops_per_sample(self) -> float:
        """Matmul FLOPs of one training sample: 3 x forward (backward = 2 x forward).

        Forward, per image with S = patches + 1 tokens, hidden H, ffn F, L blocks:
          blocks     2 * S * L * (4 H^2 + 2 H F)     (QKV, proj, fc1, fc2)
          attention  2 * 2 * S^2 * H * L            (Q K^T and attn @ V)
          embed/head 2 * patches * (C p^2) * H + 2 * H * classes
        Norms, softmax, GELU and the optimizer are not counted (the usual MFU convention).
        """
        m = self.cfg.model
        patches = (m.img_size // m.patch_size) ** 2
        s, h, f = patches + 1, m.hidden_size, int(m.hidden_size * m.mlp_ratio)
        forward = (2 * s * m.depth * (4 * h * h + 2 * h * f) + 4 * s * s * h * m.depth
                   + 2 * patches * m.in_chans * m.patch_size**2 * h + 2 * h * m.num_classes)
        return 3.0 * forward


RECIPE = ViTRecipe
