"""ESM-2 on a GPU: TE's layers (thd attention over packed sequences) against the plain-torch twins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "uniref90_sample" / "uniref90_1000.parquet"


def build_esm2(backend: str, overrides: list[str]):
    from core.layers.namespace import get_layers
    from recipes.esm2.recipe import ESM2Recipe
    from tests.support.helpers import validated_config

    cfg = validated_config("esm2_8m", ["checkpoint.path=unused", f"data.path={SAMPLE}", *overrides])
    return cfg, ESM2Recipe(cfg).build_model(get_layers(backend), torch.device("cuda"))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("multiple", [1, 8], ids=["packed", "padded_to_8"])
@pytest.mark.parametrize("autocast_dtype,rtol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_te_and_torch_esm2_agree_on_packed_sequences(autocast_dtype, rtol, multiple):
    if multiple > 1 and autocast_dtype == torch.float32:
        pytest.skip("TE has no fp32 attention for padded packs (the recipe refuses it: test_context_parallel.py)")
    """Token dropout, thd attention with cu_seqlens (empty slots, padding pieces), rotary positions restarting per
    sequence, biases, LayerNorm, GELU (TE's tanh form on both), the tied LM head: logits and gradients agree. Also
    with each sequence padded to a multiple of 8 (what context parallelism packs): TE's cu_seqlens_padded layout,
    padding between sequences left out of attention, against the twins' mask."""
    from recipes.esm2.masking import Masking
    from recipes.esm2.packing import PackedSequences
    from recipes.esm2.sequences import read_store

    cfg, te_model = build_esm2("te", ["model.num_layers=2"])
    _, torch_model = build_esm2("torch", ["model.num_layers=2"])
    te_state = {k: v for k, v in te_model.state_dict().items() if not k.endswith("_extra_state")}
    assert te_state.keys() == torch_model.state_dict().keys()
    packs = PackedSequences(
        read_store(SAMPLE), np.arange(200), 2048, 512, 32, Masking(), seed=1, shuffle_seed=2, multiple=multiple
    )
    items = [packs[k] for k in range(2)]
    batch = {key: torch.stack([item[key] for item in items]).cuda() for key in items[0]}
    real = batch["tokens"] != 1  # the padding's outputs are not compared (TE leaves them as they come)
    outputs, grads = [], []
    if multiple > 1:  # memory the allocator hands out again holds NaN: padding rows a kernel leaves unwritten show
        torch.full((1 << 28,), float("nan"), device="cuda")
    for model in (te_model, torch_model):
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
            logits = model(batch["tokens"], batch["cu_seqlens"], seqlens=batch.get("seqlens")).float()
            loss = model(batch["tokens"], batch["cu_seqlens"], labels=batch["labels"], seqlens=batch.get("seqlens"))
            loss = loss.sum()
        loss.backward()
        outputs.append(logits[real])
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"ESM-2 TE vs torch ({autocast_dtype}): logits rel diff {rel(outputs[0], outputs[1]):.2e}")
    assert rel(outputs[0], outputs[1]) < rtol
    for name in grads[1]:
        assert rel(grads[0][name], grads[1][name]) < 5 * rtol, name
