"""LoRA (core/layers/lora.py): merging a state dict's adapters into its weights."""

import pytest
import torch

from core.layers.lora import merge_lora_weights


def _pair(out: int, inp: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g)


def test_merge_fused_weight_gives_the_unmerged_output():
    w, bias = torch.randn(12, 8), torch.randn(12)
    a, b = _pair(12, 8, 3, 0)
    weights = {"m.weight": w, "m.bias": bias, "m.lora_A.weight": a, "m.lora_B.weight": b, "other.weight": torch.ones(2)}
    merged = merge_lora_weights(weights, scale=0.5)
    assert set(merged) == {"m.weight", "m.bias", "other.weight"}
    x = torch.randn(5, 8)
    unmerged = x @ w.T + bias + 0.5 * (x @ a.T @ b.T)
    torch.testing.assert_close(x @ merged["m.weight"].T + merged["m.bias"], unmerged)
    assert merged["m.bias"] is bias and merged["other.weight"] is weights["other.weight"]


def test_merge_split_qkv_weights_splits_b_rows_in_query_key_value_order():
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)
    a, b = _pair(16, 6, 2, 1)
    weights = {"qkv.query_weight": q, "qkv.key_weight": k, "qkv.value_weight": v}
    merged = merge_lora_weights({**weights, "qkv.lora_A.weight": a, "qkv.lora_B.weight": b}, scale=2.0)
    fused = merge_lora_weights(
        {"qkv.weight": torch.cat([q, k, v]), "qkv.lora_A.weight": a, "qkv.lora_B.weight": b}, 2.0
    )
    together = torch.cat([merged["qkv.query_weight"], merged["qkv.key_weight"], merged["qkv.value_weight"]])
    torch.testing.assert_close(together, fused["qkv.weight"])
    torch.testing.assert_close(merged["qkv.key_weight"], k + 2.0 * b[8:12] @ a)


def test_merge_keeps_the_weights_dtype():
    w = torch.randn(4, 4).bfloat16()
    a, b = _pair(4, 4, 2, 2)
    merged = merge_lora_weights({"m.weight": w, "m.lora_A.weight": a, "m.lora_B.weight": b}, 1.0)
    assert merged["m.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(merged["m.weight"], (w.float() + b @ a).bfloat16())


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"m.weight": torch.zeros(4, 4), "m.lora_A.weight": torch.zeros(2, 4)}, "has no m.lora_B.weight"),
        ({"m.weight": torch.zeros(4, 4), "m.lora_B.weight": torch.zeros(4, 2)}, "has no lora_A"),
        (
            {"m.bias": torch.zeros(4), "m.lora_A.weight": torch.zeros(2, 4), "m.lora_B.weight": torch.zeros(4, 2)},
            "no m.weight",
        ),
        (
            {"m.weight": torch.zeros(5, 4), "m.lora_A.weight": torch.zeros(2, 4), "m.lora_B.weight": torch.zeros(4, 2)},
            "B @ A is",
        ),
        (
            {"m.weight": torch.zeros(4, 4), "m.lora_A.weight": torch.zeros(3, 4), "m.lora_B.weight": torch.zeros(4, 2)},
            "are not",
        ),
    ],
)
def test_merge_refuses_what_does_not_fit(weights, message):
    with pytest.raises(ValueError, match=message):
        merge_lora_weights(weights, 1.0)
