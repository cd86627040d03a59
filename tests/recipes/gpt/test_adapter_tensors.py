"""What a PEFT Llama adapter's tensors must be for from-hf --base: floating point (an int8 or bool tensor was cast to
float and merged as weights it never was), and LoRA only on modules its target_modules names (PEFT builds LoRA on
those alone and leaves the others' tensors unused; they were merged too). Each is refused, naming the file and
tensor, and nothing is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recipes.gpt.hf import import_adapter_from_hf

TINY_LLAMA = Path(__file__).parents[3] / "data" / "tiny_llama"


def adapter(folder: Path, parts: str, target_modules, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT adapter for data/tiny_llama: r=4 LoRA on self_attn's `parts` (of "qkvo") in every layer."""
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (hidden // heads)
    rows = {"q": hidden, "k": kv, "v": kv, "o": hidden}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for p in parts:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{p}_proj."
            tensors[prefix + "lora_A.weight"] = torch.ones(4, hidden).to(dtype)
            tensors[prefix + "lora_B.weight"] = torch.ones(rows[p], 4).to(dtype)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": target_modules}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_an_adapter_tensor_that_is_not_floating_point_is_refused(tmp_path, dtype):
    folder = adapter(tmp_path / "adapter", "qv", ["q_proj", "v_proj"], dtype)
    named = (
        f"{folder / 'adapter_model.safetensors'}: 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' "
        f"is {dtype}, not floating point (quantized?); nothing was imported"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(named)}$"):
        import_adapter_from_hf(str(folder), str(TINY_LLAMA), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


def test_lora_on_a_module_outside_target_modules_is_refused(tmp_path):
    """target_modules ["q_proj"] with v_proj's LoRA in the file too: PEFT builds q_proj's alone (v_proj's tensors go
    unused, without a warning), so the import must not merge v_proj's."""
    folder = adapter(tmp_path / "adapter", "qv", ["q_proj"])
    named = (
        f"{folder / 'adapter_model.safetensors'}: 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight': "
        "LoRA on a module outside target_modules=['q_proj'] of adapter_config.json"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(named)}"):
        import_adapter_from_hf(str(folder), str(TINY_LLAMA), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()
    for i, targets in enumerate([["q_proj", "v_proj"], r".*\.[qv]_proj", "all-linear"]):  # control: PEFT's forms
        out = tmp_path / f"out{i}.safetensors"
        import_adapter_from_hf(str(adapter(tmp_path / f"a{i}", "qv", targets)), str(TINY_LLAMA), str(out))
        assert out.is_file()


def test_an_adapter_tensor_holding_nan_or_infinity_is_refused(tmp_path):
    folder = adapter(tmp_path / "adapter", "q", ["q_proj"])
    weights = folder / "adapter_model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(str(weights)).items()}
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"][0, 0] = float("inf")
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight' hold NaN"):
        import_adapter_from_hf(str(folder), str(TINY_LLAMA), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()
