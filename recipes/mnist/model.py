"""The MNIST models of the BioNeMo tutorial: a small trunk that squeezes an image into a few numbers,
with a decoder that rebuilds the image from them (pretraining) or a digit classifier (fine-tuning).

    trunk             pixels -> hidden -> ReLU -> latent
    decoder           latent -> hidden -> ReLU -> pixels        (task=autoencoder)
    digit_classifier  latent -> classes                         (task=classifier)

The fine-tuned model has the pretrained one's trunk under the same names, so `checkpoint.init_from`
carries it over while `digit_classifier` keeps its fresh initialisation.
"""

from __future__ import annotations

import torch
from torch import nn

from core.layers.namespace import Layers
from recipes.mnist.config import MNISTModelConfig


class MLP(nn.Module):
    """fc1 -> ReLU -> fc2."""

    def __init__(self, layers: Layers, sizes: tuple[int, int, int], device):
        super().__init__()
        self.fc1 = layers.Linear(sizes[0], sizes[1], device=device)
        self.fc2 = layers.Linear(sizes[1], sizes[2], device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class MNISTModel(nn.Module):
    def __init__(self, cfg: MNISTModelConfig, layers: Layers, device: torch.device | str = "cpu"):
        super().__init__()
        self.task = cfg.task
        pixels = cfg.image_size * cfg.image_size
        self.trunk = MLP(layers, (pixels, cfg.hidden_size, cfg.latent_size), device)
        if cfg.task == "autoencoder":
            self.decoder = MLP(layers, (cfg.latent_size, cfg.hidden_size, pixels), device)
        else:
            self.digit_classifier = layers.Linear(cfg.latent_size, cfg.num_classes, device=device)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """images [B, 1, H, W] in [0, 1] -> {"latent": [B, latent], and "reconstruction" [B, H*W]
        (autoencoder) or "logits" [B, classes] (classifier)}."""
        latent = self.trunk(images.flatten(1))
        if self.task == "autoencoder":
            return {"latent": latent, "reconstruction": self.decoder(latent)}
        return {"latent": latent, "logits": self.digit_classifier(latent)}
