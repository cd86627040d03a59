"""On a GPU: the GPT trained with TE's layers exports (`checkpoint.py to-hf`) to a LlamaForCausalLM with our
logits (the CPU side of the export: tests/recipes/gpt/test_hf.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from checkpoint import main as checkpoint_cli
from core.checkpointing.weights import read_model_weights
from recipes.gpt.model import GPT
from tests.recipes.gpt.test_hf import _train

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_te_layers_match_llama(precision, cache, tmp_path):
    """On a GPU: a checkpoint trained with TE layers exports to a Llama whose logits match our TE model's
    (fp32: TF32 matmul rounding on both sides; bf16: both run in bf16)."""
    from core.layers.namespace import get_layers

    step, cfg = _train(tmp_path, cache, "model.backend=te")
    checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype).cuda().eval()
    model = GPT(cfg.model, 384, get_layers("te"), device="cuda")
    loaded = model.load_state_dict(read_model_weights(step), strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys), loaded
    tokens = torch.randint(0, 256, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        ours, theirs = model.eval()(tokens).float(), hf(tokens).logits.float()
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    print(f"TE vs LlamaForCausalLM, {precision}: max |difference| / max |logit| = {relative:.2e}")
    assert relative <= (2e-3 if precision == "fp32" else 3e-2), relative
