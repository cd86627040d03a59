"""ESM-2 fine-tuning on a GPU: LoRA on TE's layers against LoRA on the plain-torch twins (the same parameter names,
the same outputs and gradients), and merged weights against the unmerged adapters on TE's layers. Graphed = eager
and the resume of each mode under Megatron-FSDP: tests/gpu/test_cuda_graphs.py (its esm2ft cases)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

TINY = [
    "checkpoint.path=unused",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.head_dropout=0",
    "model.activation=gelu",
    "finetune.mode=lora",
    "finetune.lora.target_modules=[layernorm_qkv,proj]",
]


def _model(backend: str, task_overrides: list[str]):
    """The esm2_finetune model with LoRA on `backend`'s layers; every lora_B drawn at random (from a fixed seed) so
    the adapters change the output."""
    from core.layers.namespace import get_layers
    from core.training import finetune
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe
    from tests.support.helpers import validated_config

    cfg = validated_config("esm2_finetune_sanity", [*TINY, *task_overrides])
    cfg = ESM2FinetuneRecipe.resolve_config(cfg)
    model = ESM2FinetuneRecipe(cfg).build_model(get_layers(backend), torch.device("cuda"))
    finetune.apply(model, cfg.finetune, cfg.seed, None)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return cfg, model


def _batch(cfg):
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe

    recipe = ESM2FinetuneRecipe(cfg)
    packs = recipe.build_datasets().val
    items = [packs[k] for k in range(2)]
    return {key: torch.stack([item[key] for item in items]).cuda() for key in items[0]}


TASKS = {
    "regression-mean": [],
    "classification-cls": ["model.task=classification", "data.label_columns=[charge_class]", "model.pooling=cls"],
    "residue": ["model.task=residue_classification", "data.label_columns=[structure]"],
}


@pytest.mark.parametrize("task", list(TASKS))
def test_lora_on_te_layers_matches_lora_on_the_twins(task):
    """The same names, and in fp32 the same logits and adapter gradients (TE's LayerNormLinear with the hook's
    recomputed LayerNorm, TE's proj with its tuple output)."""
    cfg, te_model = _model("te", TASKS[task])
    _, torch_model = _model("torch", TASKS[task])
    te_state = {k: v for k, v in te_model.state_dict().items() if not k.endswith("_extra_state")}
    assert te_state.keys() == torch_model.state_dict().keys()
    torch_model.load_state_dict(te_state)
    batch = _batch(cfg)
    outputs, grads = [], []
    for model in (te_model, torch_model):
        logits = model(batch["tokens"], batch["cu_seqlens"]).float()
        logits.square().mean().backward()
        keep = batch["tokens"] != 1 if logits.dim() == 3 and logits.shape[1] == batch["tokens"].shape[1] else None
        outputs.append(logits[keep] if keep is not None else logits)
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad})
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp(min=1e-30)).item()  # noqa: E731
    print(f"esm2_finetune {task} LoRA, TE vs torch (fp32): logits rel diff {rel(outputs[0], outputs[1]):.2e}")
    assert rel(outputs[0], outputs[1]) < 2e-3
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for name in grads[1]:
        assert rel(grads[0][name], grads[1][name]) < 1e-2, name


def test_merged_weights_give_the_adapters_logits_on_te_layers():
    from core.layers.lora import merge_lora_weights
    from core.layers.namespace import get_layers
    from recipes.esm2_finetune.recipe import ESM2FinetuneRecipe

    cfg, lora_model = _model("te", [])
    batch = _batch(cfg)
    merged_cfg = cfg  # the same model settings; a model without adapters takes the merged weights
    plain = ESM2FinetuneRecipe(merged_cfg).build_model(get_layers("te"), torch.device("cuda"))
    state = {k: v for k, v in lora_model.state_dict().items() if not k.endswith("_extra_state")}
    scale = cfg.finetune.lora.alpha / cfg.finetune.lora.rank
    missing, unexpected = plain.load_state_dict(merge_lora_weights(state, scale), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    with torch.no_grad():
        a = lora_model(batch["tokens"], batch["cu_seqlens"]).float()
        b = plain(batch["tokens"], batch["cu_seqlens"]).float()
    diff = ((a - b).norm() / b.norm()).item()
    print(f"esm2_finetune LoRA on TE: merged vs unmerged logits rel diff {diff:.2e}")
    assert diff < 3e-3  # TE's fp32 GEMMs round as TF32 (the merged weight), the adapters' torch GEMMs in fp32
