"""LoRA (core/layers/lora.py): merging a state dict's adapters into its weights; adapters on the torch twins (base
output kept at B = 0, equal to the merged weights, tuple outputs, deterministic init, targets refused by name)."""

import pytest
import torch
import torch.nn.functional as F

from core.config.errors import ConfigError
from core.layers import torch_twins
from core.layers.lora import add_lora, merge_lora_weights


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


def test_merge_checks_the_shapes_before_it_multiplies(monkeypatch):
    """A [1, n] and B [m, 1] hold n + m numbers but make an m x n B @ A: a few KB of adapter asking for gigabytes
    unless the product's shape is checked against the weight first."""
    weights = {
        "m.weight": torch.zeros(4, 4),
        "m.lora_A.weight": torch.zeros(1, 65536),
        "m.lora_B.weight": torch.zeros(32768, 1),
    }
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda *_: pytest.fail("B @ A computed before the check"))
    with pytest.raises(ValueError, match=r"LoRA of m: B @ A is \(32768, 65536\), the weights \['m.weight'\] are"):
        merge_lora_weights(weights, 1.0)


# LoRA on modules: the torch twins (TE's modules take the same hook; GPU tests in the lead's suite).


def _layer(fused: bool, seed: int = 0) -> torch_twins.TransformerLayer:
    torch.manual_seed(seed)
    return torch_twins.TransformerLayer(
        32,
        64,
        4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="padding",
        attn_input_format="thd",
        fuse_qkv_params=fused,
        bias=True,
    ).eval()


def _run(layer, x):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return layer(x, self_attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)


@pytest.mark.parametrize("fused", [True, False])
def test_lora_with_zero_b_leaves_the_output_as_it_was(fused):
    layer, x = _layer(fused), torch.randn(12, 32)
    base = _run(layer, x)
    names = add_lora(layer, ["layernorm_qkv", "proj"], rank=4, alpha=8, dropout=0.0, seed=1)
    assert names == ["self_attention.layernorm_qkv", "self_attention.proj"]
    assert torch.equal(_run(layer, x), base)


@pytest.mark.parametrize("fused", [True, False])
def test_lora_output_equals_the_merged_weights_output(fused):
    layer, x = _layer(fused), torch.randn(12, 32)
    add_lora(layer, ["layernorm_qkv", "proj"], rank=4, alpha=8, dropout=0.0, seed=1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "lora_B" in name:
                p.normal_()
    unmerged = _run(layer, x)
    plain = _layer(fused, seed=5)
    plain.load_state_dict(merge_lora_weights(layer.state_dict(), scale=8 / 4))
    merged = _run(plain, x)
    torch.testing.assert_close(unmerged, merged, rtol=1e-5, atol=1e-5)
    assert (unmerged - _run(_layer(fused), x)).abs().max() > 1e-2  # the adapters changed the output


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_lora_on_a_layernorm_linear_sees_the_normalized_input(normalization):
    torch.manual_seed(0)
    module = torch_twins.LayerNormLinear(16, 24, eps=1e-3, normalization=normalization, zero_centered_gamma=True)
    with torch.no_grad():
        module.layer_norm_weight.normal_()
    add_lora(module_holder := torch.nn.ModuleDict({"qkv": module}), ["qkv"], rank=2, alpha=6, dropout=0.0, seed=0)
    with torch.no_grad():
        module.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    w = module.layer_norm_weight + 1
    if normalization == "LayerNorm":
        normed = F.layer_norm(x, (16,), w, module.layer_norm_bias, 1e-3)
    else:
        normed = F.rms_norm(x, (16,), w, 1e-3)
    expected = (
        F.linear(normed, module.weight, module.bias) + 3.0 * normed @ module.lora_A.weight.T @ module.lora_B.weight.T
    )
    torch.testing.assert_close(module_holder["qkv"](x), expected)


def _layernorm_linear_with_lora(**kwargs) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    holder = torch.nn.ModuleDict({"qkv": torch_twins.LayerNormLinear(16, 24, eps=1e-3, **kwargs)})
    add_lora(holder, ["qkv"], rank=2, alpha=6, dropout=0.0, seed=0)
    with torch.no_grad():
        holder["qkv"].layer_norm_weight.normal_()
        holder["qkv"].lora_B.weight.normal_()
    return holder


def _reference(module, x):
    normed = F.layer_norm(x, (16,), module.layer_norm_weight, module.layer_norm_bias, 1e-3)
    update = 3.0 * normed @ module.lora_A.weight.T @ module.lora_B.weight.T
    return F.linear(normed, module.weight, module.bias) + update, normed


def test_lora_gradients_reach_the_input_and_the_norm_through_the_normalized_input():
    # The hook takes the normalized input the module returns: its gradient must flow back through the norm.
    module = _layernorm_linear_with_lora()["qkv"]
    x = torch.randn(5, 16, requires_grad=True)
    weights = [x, module.layer_norm_weight, module.layer_norm_bias, module.lora_A.weight, module.lora_B.weight]
    upstream = torch.randn(5, 24)
    got = torch.autograd.grad(module(x), weights, upstream)
    expected = torch.autograd.grad(_reference(module, x)[0], weights, upstream)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_lora_hands_back_the_normalized_input_when_the_caller_asked_for_it():
    module = _layernorm_linear_with_lora(return_layernorm_output=True)["qkv"]
    x = torch.randn(5, 16)
    out, normed = module(x)
    expected_out, expected_normed = _reference(module, x)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(normed, expected_normed)
    plain = _layernorm_linear_with_lora()["qkv"]
    assert isinstance(plain(x), torch.Tensor)  # asked for by the hook alone: the caller sees the output alone


class Linear(torch.nn.Module):
    """A layer like TE's Linear with return_bias=True: (output without bias, bias)."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


def test_lora_adds_to_the_first_element_of_a_tuple_output():
    model = torch.nn.ModuleDict({"proj": Linear()})
    add_lora(model, ["proj"], rank=2, alpha=2, dropout=0.0, seed=0)
    with torch.no_grad():
        model["proj"].lora_B.weight.fill_(1.0)
    x = torch.randn(3, 4)
    out, bias = model["proj"](x)
    torch.testing.assert_close(
        out, F.linear(x, model["proj"].weight) + x @ model["proj"].lora_A.weight.T @ torch.ones(2, 6)
    )
    assert bias is model["proj"].bias


def test_lora_init_is_drawn_from_the_seed_and_the_name_with_pefts_bound():
    a, b = _layer(True), _layer(True, seed=9)  # other base weights, other global RNG state
    torch.manual_seed(123)
    add_lora(a, ["layernorm_qkv", "proj"], rank=4, alpha=8, dropout=0.0, seed=7)
    add_lora(b, ["layernorm_qkv", "proj"], rank=4, alpha=8, dropout=0.0, seed=7)
    qkv_a = a.self_attention.layernorm_qkv.lora_A.weight
    assert torch.equal(qkv_a, b.self_attention.layernorm_qkv.lora_A.weight)
    assert not torch.equal(qkv_a, a.self_attention.proj.lora_A.weight)  # another name, other numbers
    assert qkv_a.abs().max() <= 1 / 32**0.5 and qkv_a.abs().max() > 0.5 / 32**0.5
    assert not a.self_attention.layernorm_qkv.lora_B.weight.any()
    c = _layer(True)
    add_lora(c, ["layernorm_qkv"], rank=4, alpha=8, dropout=0.0, seed=8)
    assert not torch.equal(c.self_attention.layernorm_qkv.lora_A.weight, qkv_a)


@pytest.mark.parametrize(
    "target, message",
    [
        ("fc1", "fused module \\(layernorm_mlp\\)"),
        ("layernorm_mlp", "LayerNormMLP's fc1 and fc2"),
        ("rotary", "no module of the model is named 'rotary'"),
        ("self_attention", "self_attention is a MultiheadAttention, not a Linear"),
    ],
)
def test_lora_refuses_a_target_it_cannot_take_naming_the_key_and_the_choices(target, message):
    with pytest.raises(ConfigError, match=f"finetune.lora.target_modules: .*{message}.*can target layernorm_qkv, proj"):
        add_lora(_layer(True), [target], rank=2, alpha=2, dropout=0.0, seed=0)


def test_lora_leaves_excluded_prefixes_alone():
    model = torch.nn.ModuleDict(
        {
            "body": torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 4)}),
            "head": torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 2)}),
        }
    )
    assert add_lora(model, ["dense"], rank=2, alpha=2, dropout=0.0, seed=0, exclude=("head",)) == ["body.dense"]
    assert not hasattr(model["head"]["dense"], "lora_A")
