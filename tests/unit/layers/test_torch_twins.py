"""The plain-torch twins: TE's parameter names and shapes, and TE's math (checked against explicit
formulas in float64). Against TE itself they are compared on the GPU (tests/gpu/test_te_and_megatron_fsdp.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.config.errors import ConfigError
from core.layers import torch_twins as tt
from core.layers.namespace import TORCH_LAYERS
from core.runtime import Machine, resolve_layer_backend

H, FFN, HEADS = 16, 24, 4


def names_and_shapes(module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_transformer_layer_has_te_parameter_names():
    layer = tt.TransformerLayer(H, FFN, HEADS)
    assert names_and_shapes(layer) == {
        "self_attention.layernorm_qkv.layer_norm_weight": (H,),
        "self_attention.layernorm_qkv.layer_norm_bias": (H,),
        "self_attention.layernorm_qkv.query_weight": (H, H),
        "self_attention.layernorm_qkv.query_bias": (H,),
        "self_attention.layernorm_qkv.key_weight": (H, H),
        "self_attention.layernorm_qkv.key_bias": (H,),
        "self_attention.layernorm_qkv.value_weight": (H, H),
        "self_attention.layernorm_qkv.value_bias": (H,),
        "self_attention.proj.weight": (H, H),
        "self_attention.proj.bias": (H,),
        "layernorm_mlp.layer_norm_weight": (H,),
        "layernorm_mlp.layer_norm_bias": (H,),
        "layernorm_mlp.fc1_weight": (FFN, H),
        "layernorm_mlp.fc1_bias": (FFN,),
        "layernorm_mlp.fc2_weight": (H, FFN),
        "layernorm_mlp.fc2_bias": (H,),
    }


def test_fused_qkv_rmsnorm_swiglu_gqa_no_bias_names():
    layer = tt.TransformerLayer(
        H, FFN, HEADS, num_gqa_groups=2, fuse_qkv_params=True, normalization="RMSNorm", activation="swiglu", bias=False
    )
    kv = H // HEADS
    assert names_and_shapes(layer) == {
        "self_attention.layernorm_qkv.layer_norm_weight": (H,),
        "self_attention.layernorm_qkv.weight": ((HEADS + 2 * 2) * kv, H),
        "self_attention.proj.weight": (H, H),
        "layernorm_mlp.layer_norm_weight": (H,),
        "layernorm_mlp.fc1_weight": (2 * FFN, H),
        "layernorm_mlp.fc2_weight": (H, FFN),
    }


def test_simple_modules_have_te_names():
    assert names_and_shapes(tt.Linear(3, 5)) == {"weight": (5, 3), "bias": (5,)}
    assert names_and_shapes(tt.LayerNorm(4)) == {"weight": (4,), "bias": (4,)}
    assert names_and_shapes(tt.RMSNorm(4)) == {"weight": (4,)}
    assert set(names_and_shapes(tt.LayerNormMLP(4, 6))) == {
        "layer_norm_weight",
        "layer_norm_bias",
        "fc1_weight",
        "fc1_bias",
        "fc2_weight",
        "fc2_bias",
    }


def reference_layer(x: torch.Tensor, sd: dict, heads: int, groups: int, eps: float, causal: bool) -> torch.Tensor:
    """TE TransformerLayer math written out: pre-LN attention and MLP, tanh GELU, 1/sqrt(d) scale."""
    p = "self_attention.layernorm_qkv."
    b, s, h = x.shape
    d = h // heads
    y = F.layer_norm(x, (h,), sd[p + "layer_norm_weight"], sd[p + "layer_norm_bias"], eps)
    q = (y @ sd[p + "query_weight"].T + sd[p + "query_bias"]).view(b, s, heads, d).transpose(1, 2)
    k = (y @ sd[p + "key_weight"].T + sd[p + "key_bias"]).view(b, s, groups, d).transpose(1, 2)
    v = (y @ sd[p + "value_weight"].T + sd[p + "value_bias"]).view(b, s, groups, d).transpose(1, 2)
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    x = x + attn @ sd["self_attention.proj.weight"].T + sd["self_attention.proj.bias"]
    m = "layernorm_mlp."
    y = F.layer_norm(x, (h,), sd[m + "layer_norm_weight"], sd[m + "layer_norm_bias"], eps)
    y = y @ sd[m + "fc1_weight"].T + sd[m + "fc1_bias"]
    y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    return x + y @ sd[m + "fc2_weight"].T + sd[m + "fc2_bias"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("groups", [HEADS, 2])
def test_transformer_layer_matches_te_formulas(causal, groups):
    torch.manual_seed(0)
    layer = tt.TransformerLayer(
        H,
        FFN,
        HEADS,
        num_gqa_groups=groups,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal" if causal else "no_mask",
        attn_input_format="bshd",
        layernorm_epsilon=1e-6,
    ).double()
    for p in layer.parameters():  # non-trivial norms and biases
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    expected = reference_layer(x, layer.state_dict(), HEADS, groups, 1e-6, causal)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [HEADS, 2, 1])
def test_fused_interleaved_qkv_equals_separate_qkv(groups):
    """TE's fused layout: rows grouped per KV group as [queries of the group; key; value]."""
    torch.manual_seed(0)
    kw = dict(num_gqa_groups=groups, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd")
    separate = tt.TransformerLayer(H, FFN, HEADS, **kw).double()
    fused = tt.TransformerLayer(H, FFN, HEADS, fuse_qkv_params=True, **kw).double()
    sd = separate.state_dict()
    d, per_group = H // HEADS, HEADS // groups
    p = "self_attention.layernorm_qkv."

    def interleave(kind: str) -> torch.Tensor:
        q = sd[p + f"query_{kind}"].reshape(groups, per_group * d, -1)
        k = sd[p + f"key_{kind}"].reshape(groups, d, -1)
        v = sd[p + f"value_{kind}"].reshape(groups, d, -1)
        return torch.cat([q, k, v], dim=1).reshape(-1, *sd[p + f"query_{kind}"].shape[1:])

    converted = {k: v for k, v in sd.items() if not any(k.startswith(p + n) for n in ("query", "key", "value"))}
    converted[p + "weight"], converted[p + "bias"] = interleave("weight"), interleave("bias")
    fused.load_state_dict(converted)
    x = torch.randn(3, 7, H, dtype=torch.float64)
    torch.testing.assert_close(fused(x), separate(x), rtol=1e-12, atol=1e-12)


def test_sbhd_and_bshd_agree():
    torch.manual_seed(0)
    bshd = tt.TransformerLayer(H, FFN, HEADS, attn_input_format="bshd", hidden_dropout=0.0, attention_dropout=0.0)
    sbhd = tt.TransformerLayer(H, FFN, HEADS, attn_input_format="sbhd", hidden_dropout=0.0, attention_dropout=0.0)
    sbhd.load_state_dict(bshd.state_dict())
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(sbhd(x.transpose(0, 1)).transpose(0, 1), bshd(x))


def test_glu_gates_the_first_half():
    mlp = tt.LayerNormMLP(H, FFN, activation="swiglu").double()
    x = torch.randn(4, H, dtype=torch.float64)
    y = F.layer_norm(x, (H,), mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5) @ mlp.fc1_weight.T + mlp.fc1_bias
    gate, up = y[:, :FFN], y[:, FFN:]
    expected = (F.silu(gate) * up) @ mlp.fc2_weight.T + mlp.fc2_bias
    torch.testing.assert_close(mlp(x), expected)


def test_te_default_init_and_dropout_defaults():
    layer = tt.TransformerLayer(64, 128, 4)
    w = layer.layernorm_mlp.fc1_weight
    assert abs(w.std().item() - tt.TE_DEFAULT_INIT_STD) < 0.003
    assert torch.all(layer.layernorm_mlp.fc1_bias == 0) and torch.all(layer.layernorm_mlp.layer_norm_weight == 1)
    assert layer.hidden_dropout == 0.1 and layer.self_attention.attention_dropout == 0.1  # TE's defaults
    assert layer.self_attention.causal  # TE's default mask type


def test_unsupported_options_are_errors():
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        tt.TransformerLayer(H, FFN, HEADS, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="padding"):
        tt.TransformerLayer(H, FFN, HEADS, self_attn_mask_type="padding")
    with pytest.raises(ValueError, match="activation"):
        tt.LayerNormMLP(H, FFN, activation="tanh")


def test_backend_choice_on_cpu():
    cpu = Machine(cuda=False, te=False)
    assert resolve_layer_backend("auto", cpu) == "torch"
    assert resolve_layer_backend("torch", cpu) == "torch"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_layer_backend("te", cpu)
    assert TORCH_LAYERS.TransformerLayer is tt.TransformerLayer


def test_rotary_embedding_is_te_rotate_half_and_depends_on_relative_position():
    torch.manual_seed(0)
    rope = tt.RotaryPositionEmbedding(8, rotary_base=10000.0)
    freqs = rope(6)
    assert freqs.shape == (6, 1, 1, 8) and freqs.dtype == torch.float32
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    assert torch.allclose(freqs[3, 0, 0], torch.cat([3 * inv, 3 * inv]))
    # As complex numbers: channel pairs (i, i + d/2) rotate by angle position * inv_freq[i].
    t = torch.randn(2, 6, 3, 8)  # [batch, seq, heads, head_dim]
    out = tt.apply_rotary_pos_emb(t, freqs)
    z = (
        torch.complex(t[..., :4], t[..., 4:])
        * torch.polar(torch.ones(6, 4), torch.arange(6.0)[:, None] * inv)[None, :, None]
    )
    assert torch.allclose(out, torch.cat([z.real, z.imag], dim=-1), atol=1e-5)
    # Attention scores depend only on the distance between positions.
    q, k = torch.randn(8), torch.randn(8)
    rotate = lambda v, pos: tt.apply_rotary_pos_emb(v.expand(1, 6, 1, 8), freqs)[0, pos, 0]  # noqa: E731
    assert torch.allclose(rotate(q, 4) @ rotate(k, 1), rotate(q, 5) @ rotate(k, 2), atol=1e-5)
    # Partial rotation leaves the channels past the angles' width alone.
    partial = tt.apply_rotary_pos_emb(torch.randn(1, 6, 2, 12), freqs)
    assert partial.shape == (1, 6, 2, 12)
    layer = tt.TransformerLayer(
        16,
        32,
        2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attn_input_format="bshd",
        normalization="RMSNorm",
        activation="swiglu",
        bias=False,
        fuse_qkv_params=True,
    )
    with torch.no_grad():
        layer.self_attention.layernorm_qkv.weight.mul_(30)  # sharp attention, so that positions matter
    x = torch.randn(2, 6, 16)
    assert not torch.allclose(layer(x, rotary_pos_emb=tt.RotaryPositionEmbedding(8)(6)), layer(x), atol=1e-2)


@pytest.mark.parametrize("mask, single", [("padding", "no_mask"), ("padding_causal", "causal")])
def test_packed_sequences_equal_each_sequence_alone(mask, single):
    """thd: attention within each sequence, rotary positions restarting at each, empty slots and tokens past the
    last offset (padding) harmless; the same layer, run on each sequence alone, gives the same outputs."""
    torch.manual_seed(0)
    common = dict(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True, activation="gelu_erf")
    packed = tt.TransformerLayer(H, FFN, HEADS, attn_input_format="thd", self_attn_mask_type=mask, **common).double()
    alone = tt.TransformerLayer(H, FFN, HEADS, attn_input_format="bshd", self_attn_mask_type=single, **common).double()
    alone.load_state_dict(packed.state_dict())
    with torch.no_grad():
        packed.self_attention.layernorm_qkv.weight.mul_(10)  # sharp attention: a leak between sequences shows
        alone.self_attention.layernorm_qkv.weight.mul_(10)
    lengths, tail = [5, 3, 0, 7], 4
    cu = torch.tensor([0, 5, 8, 8, 15], dtype=torch.int32)
    x = torch.randn(sum(lengths) + tail, H, dtype=torch.float64)
    angles = tt.RotaryPositionEmbedding(H // HEADS)(16)
    out = packed(x, rotary_pos_emb=angles, self_attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16)
    assert out.shape == x.shape and torch.isfinite(out).all()
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n:
            torch.testing.assert_close(
                out[start : start + n], alone(x[None, start : start + n], rotary_pos_emb=angles)[0]
            )
    moved = x.clone()
    moved[5:8] = torch.randn(3, H, dtype=torch.float64)  # another second sequence: the others do not change
    again = packed(moved, rotary_pos_emb=angles, cu_seqlens_q=cu)
    torch.testing.assert_close(again[:5], out[:5])
    torch.testing.assert_close(again[8:], out[8:])
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed(x, rotary_pos_emb=angles)


def test_packed_mask_type_of_the_call_wins_over_the_constructors():
    """As in TE, a call's self_attn_mask_type decides: a layer built "padding" runs causally when called with
    "padding_causal" (a causal model on packed documents), and one built "padding_causal" sees the whole
    sequence when called with "padding"."""
    torch.manual_seed(0)
    common = dict(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True, attn_input_format="thd")
    layer = tt.TransformerLayer(H, FFN, HEADS, self_attn_mask_type="padding", **common).double()
    causal = tt.TransformerLayer(H, FFN, HEADS, self_attn_mask_type="padding_causal", **common).double()
    causal.load_state_dict(layer.state_dict())
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = torch.randn(9, H, dtype=torch.float64)
    for mask in ("padding", "padding_causal"):
        torch.testing.assert_close(
            layer(x, self_attn_mask_type=mask, cu_seqlens_q=cu), causal(x, self_attn_mask_type=mask, cu_seqlens_q=cu)
        )
    changed = x.clone()
    changed[3] = torch.randn(H, dtype=torch.float64)  # the first sequence's last token: only itself sees it, causal
    out, again = (layer(t, self_attn_mask_type="padding_causal", cu_seqlens_q=cu) for t in (x, changed))
    torch.testing.assert_close(again[:3], out[:3])
    assert not torch.allclose(
        layer(changed, self_attn_mask_type="padding", cu_seqlens_q=cu)[:3],
        layer(x, self_attn_mask_type="padding", cu_seqlens_q=cu)[:3],
    )
    torch.testing.assert_close(again[4:], out[4:])  # nor does the other sequence


def test_packed_positions():
    sequence, position = tt.packed_positions(torch.tensor([0, 2, 2, 5], dtype=torch.int32), 7)
    assert sequence.tolist() == [0, 0, 2, 2, 2, 3, 3]
    assert position.tolist() == [0, 1, 0, 1, 2, 0, 1]


def test_exact_gelu_is_erf_and_gelu_is_tanh():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    torch.testing.assert_close(tt.ACTIVATIONS["gelu_erf"](x), x * 0.5 * (1 + torch.erf(x / math.sqrt(2))))
    assert (tt.ACTIVATIONS["gelu"](x) - tt.ACTIVATIONS["gelu_erf"](x)).abs().max() > 1e-4  # TE's: the tanh form
