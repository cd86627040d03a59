"""Vision Transformer (Dosovitskiy et al., 2021): patch embedding, class token, learned position
embedding, pre-norm transformer blocks, final norm, linear head.

Built from a `Layers` namespace, so the same code is TE on GPU and plain torch elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from core.layers.namespace import Layers
from recipes.vit.config import ViTModelConfig


class PatchEmbed(nn.Module):
    """Non-overlapping patches flattened in (channel, row, column) order, then one linear layer.

    Equal to a Conv2d with kernel = stride = patch_size whose weight is `proj.weight` reshaped to
    [hidden, in_chans, patch, patch]; a Linear lets TE run it (and FP8 it) like any other GEMM.
    """

    def __init__(self, layers: Layers, img_size: int, patch_size: int, in_chans: int, hidden_size: int, device):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} is not a multiple of patch_size={patch_size}")
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = layers.Linear(in_chans * patch_size * patch_size, hidden_size, device=device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.patch_size
        patches = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.proj(patches.reshape(b, (h // p) * (w // p), c * p * p))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTModelConfig, layers: Layers, device: torch.device | str = "cpu"):
        super().__init__()
        h = cfg.hidden_size
        if h % cfg.num_heads:
            raise ValueError(f"hidden_size={h} is not divisible by num_heads={cfg.num_heads}")
        self.high_precision = layers.high_precision  # outside FP8: see forward
        self.patch_embed = PatchEmbed(layers, cfg.img_size, cfg.patch_size, cfg.in_chans, h, device)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, h, device=device))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, h, device=device))
        self.blocks = nn.ModuleList(
            layers.TransformerLayer(
                hidden_size=h,
                ffn_hidden_size=int(h * cfg.mlp_ratio),
                num_attention_heads=cfg.num_heads,
                layernorm_epsilon=cfg.layernorm_epsilon,
                hidden_dropout=cfg.hidden_dropout,
                attention_dropout=cfg.attention_dropout,
                self_attn_mask_type="no_mask",
                attn_input_format="bshd",
                fuse_qkv_params=cfg.fuse_qkv_params,
                bias=cfg.qkv_bias,
                activation="gelu",
                normalization="LayerNorm",
                layer_number=i + 1,
                device=device,
            )
            for i in range(cfg.depth)
        )
        self.norm = layers.LayerNorm(h, eps=cfg.layernorm_epsilon, device=device)
        self.head = layers.Linear(h, cfg.num_classes, device=device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # Embedding and head stay in bf16/fp32 under FP8: the first and last GEMMs are the most
        # sensitive and the head's width (classes) need not be a multiple of 16.
        with self.high_precision():
            x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        x = x + self.pos_embed.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        with self.high_precision():
            return self.head(self.norm(x[:, 0]))
