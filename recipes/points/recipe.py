"""The points recipe: regression of y = w . x + b on points x seen with fresh noise in every epoch.

torchrun --nproc-per-node 2 train.py --config-name points
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.data.datasets import epoch_index, sample_generator
from core.layers.namespace import Layers
from core.layers.weight_init import init_parameters, linear_default_rule
from recipes.base import Datasets, Recipe
from recipes.points.config import PointsDataConfig, PointsModelConfig


class NoisyPoints(torch.utils.data.Dataset):
    """Sample i: point i with noise drawn from (seed, epoch, i), and its clean target: the same sample every time
    it is asked for (core.data.checks.assert_dataset_deterministic), so a resumed run sees what the first would."""

    def __init__(self, points: torch.Tensor, targets: torch.Tensor, noise: float, seed: int):
        self.points, self.targets, self.noise, self.seed = points, targets, noise, seed

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index) -> dict:  # an int (validation) or an EpochIndex (training)
        epoch, idx = epoch_index(index)
        g = sample_generator(self.seed, epoch, idx)  # never torch.randn(...) without a generator
        x = self.points[idx] + self.noise * torch.randn(self.points.shape[1:], generator=g)
        return {"x": x, "y": self.targets[idx], "idx": idx}


def make_points(data: PointsDataConfig) -> Datasets:
    """The training and validation points, and y = w . x + b, from data.seed."""
    g = torch.Generator().manual_seed(data.seed)
    w, b = torch.randn(data.dims, generator=g), torch.randn((), generator=g)
    points = torch.randn(data.train_points + data.val_points, data.dims, generator=g)
    targets = points @ w + b
    n = data.train_points
    return Datasets(
        NoisyPoints(points[:n], targets[:n], data.noise, data.seed),
        NoisyPoints(points[n:], targets[n:], data.noise, data.seed + 1),
    )


class PointsModel(nn.Module):
    def __init__(self, dims: int, hidden: int, layers: Layers, device: torch.device):
        super().__init__()
        self.fc1 = layers.Linear(dims, hidden, device=device)
        self.fc2 = layers.Linear(hidden, 1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, dims] -> y [B, 1]."""
        return self.fc2(torch.relu(self.fc1(x)))


class PointsRecipe(Recipe):
    name = "points"
    model_schema = PointsModelConfig
    data_schema = PointsDataConfig

    def build_model(self, layers: Layers, device: torch.device) -> nn.Module:
        model = PointsModel(self.cfg.data.dims, self.cfg.model.hidden_size, layers, device)
        init_parameters(model, self.cfg.seed, linear_default_rule(model))
        return model

    def unit_modules(self, layers: Layers) -> list[type]:
        return [layers.Linear]  # FSDP gathers and frees each layer on its own

    def build_datasets(self) -> Datasets:
        return make_points(self.cfg.data)

    def forward(self, model: nn.Module, batch: dict, training: bool) -> dict[str, torch.Tensor]:
        """Per sample: the squared error, one loss term."""
        loss = F.mse_loss(model(batch["x"])[:, 0].float(), batch["y"].float(), reduction="none")
        return {"loss": loss, "count": torch.ones_like(loss)}


RECIPE = PointsRecipe
