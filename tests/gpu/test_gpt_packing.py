"""GPU tests of the GPT's packed rows with document masks (recipes/gpt/packing.py) on TransformerEngine's layers:
thd attention with padding_causal and rotary positions restarting per document, `pytest -m gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ, VOCAB = 256, 512
DOCUMENTS = [[100, 60, 96], [128, 27]]  # per row; the second row ends in padding


def _models():
    """A 2-block GPT with TE layers and with the twins, the same weights, on the GPU. The QKV weights are scaled up
    so attention is far from uniform: a document that saw another one, or a shifted position, changes the logits."""
    from core.layers.namespace import TORCH_LAYERS, get_layers
    from recipes.gpt.config import GPTModelConfig
    from recipes.gpt.model import GPT

    cfg = GPTModelConfig(
        seq_length=SEQ, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512
    )
    torch.manual_seed(0)
    twin = GPT(cfg, VOCAB, TORCH_LAYERS, device="cuda")
    with torch.no_grad():
        for block in twin.layers:
            block.self_attention.layernorm_qkv.weight.mul_(5)
    te_model = GPT(cfg, VOCAB, get_layers("te"), device="cuda")
    te_model.load_state_dict(twin.state_dict(), strict=False)  # (TE's _extra_state entries stay)
    return twin, te_model


def _batch():
    from recipes.gpt.packing import row_offsets

    tokens = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cu = torch.from_numpy(np.stack([row_offsets(d, SEQ, 5) for d in DOCUMENTS])).cuda()
    return tokens, cu


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_packed_rows_give_each_document_alone(dtype):
    """TE's packed rows (one thd stream, padding_causal, RoPE per document) = each document run alone on TE's
    plain causal path, and = the twins' packed rows; the whole row run unpacked differs (the masks matter)."""
    twin, te_model = _models()
    tokens, cu = _batch()
    # fp32: TF32 matmuls round at ~1e-3 relative; bf16: its rounding.
    tolerance = dict(rtol=2e-3, atol=3e-3) if dtype == torch.float32 else dict(rtol=0.05, atol=0.06)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        packed = te_model(tokens, cu_seqlens=cu).float()
        for row, lengths in enumerate(DOCUMENTS):
            start = 0
            for n in lengths:
                alone = te_model(tokens[row : row + 1, start : start + n])[0].float()
                torch.testing.assert_close(packed[row, start : start + n], alone, **tolerance)
                start += n
        torch.testing.assert_close(packed, twin(tokens, cu_seqlens=cu).float(), **tolerance)
        unpacked = te_model(tokens).float()
        assert (unpacked[0, 100:160] - packed[0, 100:160]).abs().max() > 0.1


def test_te_packed_loss_gradients_match_the_twins():
    """The packed loss's gradients on TE's layers (fused QKV-RoPE backward, thd attention backward) = the twins'."""
    twin, te_model = _models()
    tokens, cu = _batch()
    labels = torch.roll(tokens, -1, 1)
    grads = []
    for model in (twin, te_model):
        model.zero_grad()
        model(tokens, labels=labels, cu_seqlens=cu).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, expected in grads[0].items():
        got = grads[1][name]
        assert got is not None and torch.isfinite(got).all(), name
        scale = expected.abs().max().clamp(min=1e-6)
        assert (got - expected).abs().max() / scale < 2e-2, name
