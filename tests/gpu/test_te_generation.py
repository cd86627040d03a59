"""GPU tests of generation with TransformerEngine's KV cache (te.InferenceParams): `pytest -m gpu`."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from tests.support.helpers import compose_config, train_run, validated_config

pytestmark = pytest.mark.gpu


def _models():
    """The gpt_sanity model with TE layers and with the twins, the same weights, on the GPU."""
    from core.layers.namespace import TORCH_LAYERS, get_layers
    from recipes.gpt.model import GPT

    cfg = validated_config("gpt_sanity", ["checkpoint.path=unused"])
    torch.manual_seed(0)
    twin = GPT(cfg.model, 384, TORCH_LAYERS, device="cuda").eval()
    te_model = GPT(cfg.model, 384, get_layers("te"), device="cuda").eval()
    te_model.load_state_dict(twin.state_dict(), strict=False)  # (TE's _extra_state entries stay)
    return twin, te_model


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_kv_cache_gives_the_logits_of_a_whole_pass(dtype):
    """Prefill 20 tokens, then 12 steps of one token through TE's cache: the logits of one pass over all
    32 tokens, with TE layers and with the twins (bf16: within its rounding)."""
    twin, te_model = _models()
    tokens = torch.randint(0, 256, (1, 32), device="cuda")
    # fp32: TF32 matmuls on the GPU (torch and TE alike) round at ~1e-3 relative.
    tolerance = dict(rtol=1e-3, atol=2e-3) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        whole = twin(tokens).float()
        for model in (te_model, twin):
            cache = model.new_kv_cache(1, 64, dtype)
            cache.pre_step(OrderedDict({0: 20}))
            parts = [model(tokens[:, :20], kv_cache=cache)]
            for i in range(20, 32):
                cache.pre_step(OrderedDict({0: 1}))
                parts.append(model(tokens[:, i : i + 1], kv_cache=cache))
            torch.testing.assert_close(torch.cat(parts, dim=1).float(), whole, **tolerance)


def test_generate_with_te_greedy_cache_equals_recomputing(tmp_path):
    """gpt_sanity trained on the GPU with TE layers; generate.py's greedy text with TE's KV cache equals the
    text from recomputing the whole sequence for every token."""
    import generate

    cfg = validated_config(
        "gpt_sanity",
        [
            "training.steps=80",
            "training.val_every_n_steps=80",
            "data.num_workers=0",
            "logger.progress_bar=never",
            f"data.cache_dir={tmp_path}/cache",
            f"checkpoint.path={tmp_path}/ckpt",
            "model.backend=te",
        ],
    )
    train_run(cfg, tmp_path / "run")
    texts = []
    for kv in ("true", "false"):
        gen = compose_config(
            "gpt_sanity",
            [
                f"checkpoint.init_from={tmp_path}/ckpt/step_80",
                "model.backend=te",
                f"data.cache_dir={tmp_path}/cache",
                f"checkpoint.path={tmp_path}/unused",
                "generate.prompt='Call me Ishmael. '",
                "generate.greedy=true",
                "generate.max_new_tokens=200",
                f"generate.kv_cache={kv}",
            ],
        )
        texts.append(generate.generate(gen, tmp_path / f"gen_{kv}")[0].text)
    print("greedy continuation:", repr(texts[0][:120]))
    assert texts[0] == texts[1]
