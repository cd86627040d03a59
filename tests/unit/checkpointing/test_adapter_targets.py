"""An adapter's LoRA tensors must sit on modules its adapter_config.json's target_modules takes (and exclude_modules
leaves): PEFT builds LoRA there alone and leaves other tensors unused, so from-hf --base merged more than PEFT does.
The matching is PEFT's, checked here against peft itself on a tiny Llama: a list of names (a module's full name,
or its end after a "."), a regular expression matched whole, "all-linear"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.checkpointing.hf_folders import PEFT_PREFIX, check_adapter_targets

MODULES = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
CONFIGS = [
    {"target_modules": ["q_proj"]},
    {"target_modules": ["q_proj", "v_proj", "gate_proj"]},
    {"target_modules": ["self_attn.o_proj", "model.layers.1.self_attn.k_proj"]},
    {"target_modules": ["proj", "attn.q_proj", "o_proj"]},  # a name is a whole part of the full name
    {"target_modules": r".*\.(q|v)_proj"},
    {"target_modules": r"q_proj|model\.layers\.0\.self_attn\.k_proj"},  # a regular expression matches it whole
    {"target_modules": r"model\.layers\.1\..*_proj"},
    {"target_modules": "all-linear"},
    {"target_modules": "ALL-LINEAR"},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": ["model.layers.0.self_attn.k_proj"]},
    {"target_modules": "all-linear", "exclude_modules": r".*\.[kv]_proj"},
]


def peft_modules(config: dict) -> set[str]:
    """The modules peft builds LoRA on for `config`, on a tiny LlamaForCausalLM."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = peft.get_peft_model(LlamaForCausalLM(llama), peft.LoraConfig(r=2, **config))
    prefix = "base_model." + PEFT_PREFIX.removeprefix("base_model.")
    return {n.removeprefix(prefix).removesuffix(".lora_A") for n, _ in model.named_modules() if n.endswith("lora_A")}


def ours(config: dict, module: str) -> bool:
    tensors = {f"{PEFT_PREFIX}{module}.lora_{side}.weight": torch.zeros(1) for side in "AB"}
    try:
        check_adapter_targets(config, tensors, Path("adapter"))
    except ValueError as e:
        assert f"{module}.lora_A.weight': LoRA on a module " in str(e)
        return False
    return True


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_the_modules_taken_are_peft_s(config):
    expected = peft_modules(config)
    assert expected and expected != set(MODULES) or config["target_modules"].lower() == "all-linear"
    assert {m for m in MODULES if ours(config, m)} == expected & set(MODULES)


def test_a_tensor_outside_target_modules_is_named_with_its_file_and_target_modules():
    tensors = {f"{PEFT_PREFIX}model.layers.0.self_attn.{p}_proj.lora_A.weight": torch.zeros(1) for p in "qv"}
    tensors[f"{PEFT_PREFIX}classifier.weight"] = torch.zeros(1)  # not LoRA (modules_to_save): not for this check
    check_adapter_targets({"target_modules": ["q_proj", "v_proj"]}, tensors, Path("adapter"))
    with pytest.raises(
        ValueError,
        match=r"^adapter/adapter_model.safetensors: 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight': "
        r"LoRA on a module outside target_modules=\['q_proj'\] of adapter_config.json \(PEFT builds no LoRA there "
        r"and leaves the tensor unused\); nothing was imported$",
    ):
        check_adapter_targets({"target_modules": ["q_proj"]}, tensors, Path("adapter"))


@pytest.mark.parametrize(
    "config, named",
    [
        ({}, r"target_modules=None: expected a list of module names or a regular expression"),
        ({"target_modules": ["q_proj", 1]}, r"target_modules=\['q_proj', 1\]: expected a list"),
        ({"target_modules": "(q_proj"}, r"target_modules='\(q_proj': not a regular expression \(missing \)"),
        ({"target_modules": "all-linear", "exclude_modules": {"q": 1}}, r"exclude_modules=\{'q': 1\}: expected"),
    ],
)
def test_target_modules_of_another_form_is_refused_by_key(config, named):
    with pytest.raises(ValueError, match=rf"^adapter/adapter_config.json: {named}.*; nothing was imported$"):
        check_adapter_targets(config, {}, Path("adapter"))
