"""The fine-tuning recipe's FLOPs (MFU's numerator) as finetune.mode trains: full fine-tuning 6 N per token and the
attention's 12 L H s^2, a frozen backbone its forward only (2 N, 4 L H s^2) with the head's full 6 N, LoRA the
backbone's forward and input gradients (4 N, 12 L H s^2) and 6 per adapter parameter; against a hand count of a
tiny model (whose parameters are counted from the model itself too)."""

from __future__ import annotations

import pytest
import torch

from core.layers.namespace import TORCH_LAYERS
from core.training import finetune

# L = 1 block, h = 32, f = 64; the classification task's 3 classes (acidic, basic, neutral), the residue task's 3.
TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64"]
TASKS = {
    "classification": ["model.task=classification", "data.label_columns=[charge_class]"],
    "residue_classification": ["model.task=residue_classification", "data.label_columns=[structure]"],
}
# By hand: QKV 3h^2 + 3h, proj h^2 + h, fc1 hf + f, fc2 fh + h, two LayerNorms 4h; the final norm 2h.
BACKBONE = (3 * 32 * 32 + 3 * 32) + (32 * 32 + 32) + (32 * 64 + 64) + (64 * 32 + 32) + 4 * 32 + 2 * 32  # 8608
HEAD = {"classification": (32 * 32 + 32) + (32 * 3 + 3), "residue_classification": 32 * 3 + 3}  # 1155, 99
ADAPTERS = 4 * (32 + 3 * 32) + 4 * (32 + 32)  # rank 4 on layernorm_qkv [3h, h] and proj [h, h]: 768
# A micro-batch of one row holding sequences of 12 and 18 tokens and an empty slot.
BATCH = {"sequences": torch.tensor([[0, 1, -1]]), "cu_seqlens": torch.tensor([[0, 12, 30, 30]], dtype=torch.int32)}
TOKENS, SQUARES, SEQUENCES = 30, 12 * 12 + 18 * 18, 2


def recipe_of(mode: str, task: str, *extra: str):
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe
    from tests.support.helpers import validated_config

    overrides = ["checkpoint.path=unused", *TINY, *TASKS[task], f"finetune.mode={mode}", "finetune.lora.rank=4"]
    cfg = validated_config("esm2_finetune_sanity", [*overrides, *extra])
    return ESM2FinetuneRecipe(ESM2FinetuneRecipe.resolve_config(cfg, is_main=False))


def counted(recipe) -> dict[str, int]:
    """The model's own parameters after finetune.apply: backbone (without the embedding table, which multiplies
    nothing), head, adapters; of out_proj (and an adapter's lora_B on it) the rows of the K outputs, not the rows it
    pads them with (recipes/esm2_finetune/model.py:out_rows), whose outputs are never used."""
    model = recipe.build_model(TORCH_LAYERS, torch.device("cpu"))
    finetune.apply(model, recipe.cfg.finetune, recipe.cfg.seed, None)
    parts, k = {"backbone": 0, "head": 0, "adapters": 0}, len(recipe.cfg.model.classes)
    for name, p in model.named_parameters():
        part = "adapters" if finetune.is_lora(name) else "head" if name.startswith("head.") else "backbone"
        used = p[:k] if name.startswith("head.out_proj.") and "lora_A" not in name else p
        parts[part] += used.numel() if name != "embedding.weight" else 0
    return parts


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("mode", ["full", "frozen", "lora"])
def test_the_flops_of_each_mode_are_the_hand_count(mode, task):
    recipe = recipe_of(mode, task)
    assert counted(recipe) == {"backbone": BACKBONE, "head": HEAD[task], "adapters": ADAPTERS if mode == "lora" else 0}
    backbone, attention = {"full": (6, 12), "frozen": (2, 4), "lora": (4, 12)}[mode]
    per_token_head = HEAD[task] if task == "residue_classification" else 0
    per_sequence_head = HEAD[task] - per_token_head
    adapters = ADAPTERS if mode == "lora" else 0
    expected = (
        backbone * BACKBONE * TOKENS
        + attention * 1 * 32 * SQUARES
        + 6 * (per_token_head * TOKENS + per_sequence_head * SEQUENCES)
        + 6 * adapters * TOKENS
    )
    tokens, flops = recipe.work(BATCH)
    assert tokens.item() == TOKENS and flops.item() == expected
    # A full row: tokens_per_pack tokens in sequences of model.max_seq_length.
    t, s = recipe.tokens_per_sample(), recipe.cfg.model.max_seq_length
    per_token = backbone * BACKBONE + attention * 32 * s + 6 * per_token_head + 6 * adapters
    assert recipe.flops_per_sample() == pytest.approx(t * per_token + 6 * per_sequence_head * t / s, rel=1e-12)


def test_lora_with_part_of_the_head_left_out_of_finetune_head():
    """finetune.head=[head.dense]: dense trains (6 per parameter); out_proj is frozen like the backbone (4: the gradient
    passes through it to the adapters) and, targeted, takes an adapter (per sequence: on the pooled vector)."""
    recipe = recipe_of(
        "lora", "classification", "finetune.head=[head.dense]", "finetune.lora.target_modules=[proj,out_proj]"
    )
    proj, out_proj = 4 * (32 + 32), 4 * (32 + 3)
    assert counted(recipe) == {"backbone": BACKBONE, "head": HEAD["classification"], "adapters": proj + out_proj}
    tokens, flops = recipe.work(BATCH)
    dense, classifier = 32 * 32 + 32, 32 * 3 + 3
    expected = 4 * BACKBONE * TOKENS + 12 * 32 * SQUARES + (6 * dense + 4 * classifier) * SEQUENCES
    assert flops.item() == expected + 6 * proj * TOKENS + 6 * out_proj * SEQUENCES
