"""The ViT recipe: image classification with a Vision Transformer."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from core.checkpointing.layout import resolve_checkpoint
from core.config.errors import ConfigError
from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, standard_rule
from core.training.memory_plan import BlockShape
from recipes.base import Datasets, Recipe
from recipes.vit.config import ImageDataConfig, ViTModelConfig
from recipes.vit.data import (
    ImagesToPredict,
    Transform,
    build_image_datasets,
    collate_encoded,
    decode_batch,
    default_prediction_split,
    image_classes,
    prediction_samples,
)
from recipes.vit.jpeg import CUDA_CONNECTIONS
from recipes.vit.model import VisionTransformer

log = logging.getLogger("train")


class ViTRecipe(Recipe):
    name = "vit"
    model_schema = ViTModelConfig
    model_data_keys = ("num_classes", "val_crop_fraction", "mean", "std")  # the head, the crop, the normalization
    data_schema = ImageDataConfig
    predict_config = "vit_predict"
    tiny_configs = {
        "": (
            "vit_sanity",
            (
                "data=synthetic",
                "data.num_classes=10",
                "data.synthetic_val_size=4",
                "model.hidden_size=32",
                "model.depth=1",
                "model.num_heads=2",
            ),
        )
    }

    @classmethod
    def resolve_config(cls, cfg, is_main: bool = True):
        """data.num_classes: null -> the number of classes the data holds (and the model's head with it);
        an explicit number must be that one."""
        data_cfg, model_cfg = cfg.data, cfg.model
        if data_cfg.format == "synthetic":
            return cfg
        if len(data_cfg.mean) != model_cfg.in_chans:  # the images are normalized channel by channel
            raise ConfigError(
                f"data.mean and data.std have {len(data_cfg.mean)} values, but "
                f"model.in_chans={model_cfg.in_chans}: expected one per channel"
            )
        try:
            found, data_found = len(image_classes(data_cfg)), True
        except FileNotFoundError as e:  # e.g. predict.py on a folder of new images, with the checkpoint only
            found, data_found = cls._num_classes_without_data(cfg, e, is_main), False
        for key, given in (("data.num_classes", data_cfg.num_classes), ("model.num_classes", model_cfg.num_classes)):
            if given is not None and given != found:
                raise ConfigError(f"{key}={given}, but {data_cfg.root} holds {found} classes (null takes the data's)")
        if data_cfg.num_classes == found and model_cfg.num_classes == found:
            return cfg
        cfg = cfg.copy()
        OmegaConf.set_readonly(cfg, False)
        cfg.data.num_classes = cfg.model.num_classes = found
        OmegaConf.set_readonly(cfg, True)
        if data_found and is_main:
            log.info("data.num_classes=%d: the classes %s holds", found, data_cfg.root)
        return cfg

    @staticmethod
    def _num_classes_without_data(cfg, missing: FileNotFoundError, is_main: bool) -> int:
        """The class count when data.root is not there: the one given, else the one in the config.yaml of the
        checkpoint.init_from step folder (the trained head's). Training then stops at the missing data."""
        data_cfg, model_cfg = cfg.data, cfg.model
        given = data_cfg.num_classes if data_cfg.num_classes is not None else model_cfg.num_classes
        source = "as given"
        saved = resolve_checkpoint(cfg.checkpoint.init_from) / "config.yaml" if cfg.checkpoint.init_from else None
        if given is None and saved is not None and saved.is_file():
            from core.checkpointing.saved_config import read_saved_config
            from recipes.registry import get_recipe

            trained = read_saved_config(saved, get_recipe, expected_recipe=ViTRecipe.name)  # read as plain data
            given, source = trained.settings["model.num_classes"], f"from {saved}"
        if given is None:
            raise ConfigError(
                f"data.num_classes=null takes the count from the data, but {missing}; "
                "give data.num_classes (the trained model's) or a data.root that exists"
            )
        if is_main:
            log.warning("%s; num_classes=%d %s", missing, given, source)
        return int(given)

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = VisionTransformer(self.cfg.model, layers, device=device)
        init_parameters(model, self.cfg.seed, standard_rule(self.cfg.model.init_std))
        return model

    def block_shape(self) -> BlockShape:
        m = self.cfg.model
        ffn = int(m.hidden_size * m.mlp_ratio)
        return BlockShape(m.depth, m.hidden_size, ffn, m.hidden_size, gated=False)

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.TransformerLayer]

    def no_weight_decay(self, model: nn.Module) -> set[str]:
        return {"cls_token", "pos_embed"}

    def build_datasets(self) -> Datasets:
        return Datasets(*build_image_datasets(self.cfg.data, self.cfg.model, self.cfg.seed))

    def collate_fn(self):
        return collate_encoded if self.cfg.data.decode_on == "device" else None

    def to_device(self, batch: dict, device: torch.device) -> dict:
        if "jpeg" in batch:  # data.decode_on=device: decode and augment here (the workers drew the crops)
            return decode_batch(batch, self._device_transform, device, self.cfg.data.device_decoder)
        batch = super().to_device(batch, device)
        if batch["image"].dtype == torch.uint8:  # the workers' augmented pixels: floats made here, a quarter the bytes
            batch["image"] = self._device_transform.normalize(batch["image"])
        return batch

    def prefetch_threads(self) -> int:
        return self.cfg.data.decode_threads if self.cfg.data.decode_on == "device" else 1

    def cuda_connections(self) -> Optional[int]:
        # The decoder's streams and the step's each get a queue of their own (docs/performance.md).
        return CUDA_CONNECTIONS if self.cfg.data.decode_on == "device" else None

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
        out = {
            "loss": F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing),
            "count": torch.ones_like(labels, dtype=torch.float32),
        }
        if not training:
            top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            out["top1"] = (top5[:, 0] == labels).float()
            out["top5"] = (top5 == labels[:, None]).any(dim=-1).float()
        return out

    def validation_metrics(self) -> tuple[str, ...]:
        return ("loss", "top1", "top5")

    # --- prediction (predict.py) ---------------------------------------------------------------
    def default_split(self) -> str:
        """test where the data has that split (a folder of the root, a split of the shards), else val."""
        return "val" if self.cfg.data.format == "synthetic" else default_prediction_split(self.cfg.data)

    def split(self, name: str):
        if self.cfg.data.format == "synthetic":
            raise ConfigError(
                f"predict.split={name}: data.format=synthetic has no image files to predict on; give "
                "the data the model was trained on (data=imagefolder data.root=...) or predict.folder"
            )
        classes = image_classes(self.cfg.data)
        samples = prediction_samples(self.cfg.data, self.cfg.model, self.cfg.seed, name, None, classes)
        return ImagesToPredict(samples, Path(self.cfg.data.root), classes)

    def unlabeled(self, folder: str):
        samples = prediction_samples(self.cfg.data, self.cfg.model, self.cfg.seed, None, folder)
        names = None if self.cfg.data.format == "synthetic" else self._class_names()
        return ImagesToPredict(samples, Path(folder), names)

    def predict(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per image: its label (-1: none), the 5 most likely classes and their probabilities."""
        probs = model(batch["image"]).float().softmax(dim=-1)
        top = probs.topk(min(5, probs.shape[-1]), dim=-1)
        return {"idx": batch["idx"], "label": batch["label"], "top": top.indices, "prob": top.values}

    def finish_predictions(self, images: ImagesToPredict, columns: dict[str, torch.Tensor]) -> dict:
        """Adds the image's path (relative to the folder predicted on, or the data root) and the top classes'
        names, where they are known."""
        paths = [Path(images.samples.files[i][0]) for i in columns["idx"].tolist()]
        files = [str(p.relative_to(images.base)) if p.is_relative_to(images.base) else str(p) for p in paths]
        out = {
            "idx": columns["idx"],
            "file": files,
            "label": columns["label"],
            "top": columns["top"],
            "prob": columns["prob"],
        }
        if images.class_names is not None:
            out["top_name"] = [[images.class_names[i] for i in row] for row in columns["top"].tolist()]
        return out

    def _class_names(self) -> Optional[list[str]]:
        """The trained model's class names, read from its data; None (warned) if the data is not here."""
        try:
            return image_classes(self.cfg.data)
        except FileNotFoundError as e:
            log.warning("class names unknown (%s): the output has class indices only", e)
            return None

    def summarize_predictions(self, columns: dict) -> dict[str, float | int]:
        """top-1 / top-5 accuracy over the images that have labels."""
        labelled = columns["label"] >= 0
        result: dict[str, float | int] = {"images": len(columns["label"]), "labelled": int(labelled.sum())}
        if labelled.any():
            top, labels = columns["top"][labelled], columns["label"][labelled]
            result["top1"] = (top[:, 0] == labels).double().mean().item()
            result["top5"] = (top == labels[:, None]).any(dim=-1).double().mean().item()
        return result

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
        model_cfg = self.cfg.model
        patches = (model_cfg.img_size // model_cfg.patch_size) ** 2
        s, h, f = patches + 1, model_cfg.hidden_size, int(model_cfg.hidden_size * model_cfg.mlp_ratio)
        forward = (
            2 * s * model_cfg.depth * (4 * h * h + 2 * h * f)
            + 4 * s * s * h * model_cfg.depth
            + 2 * patches * model_cfg.in_chans * model_cfg.patch_size**2 * h
            + 2 * h * model_cfg.num_classes
        )
        return 3.0 * forward


RECIPE = ViTRecipe
