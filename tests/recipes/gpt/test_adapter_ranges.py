"""A PEFT adapter's r and lora_alpha are held to finetune.lora's ranges (core/config/schema.py LoraConfig) before
anything is written: lora_alpha=1e400 (inf in JSON) or an alpha that fused q/k/v scale beyond them would write the
weights and print a finetune.lora setting that the config refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.checkpointing.hf_folders import check_adapter_config, our_lora_alpha

TINY_LLAMA = Path(__file__).parents[3] / "data" / "tiny_llama"


@pytest.mark.parametrize(
    "r, alpha, says",
    [
        (4, float("inf"), r"lora_alpha=inf: expected 0 < lora_alpha <= 1e6"),
        (4, float("nan"), r"lora_alpha=nan"),
        (4, 2e6, r"lora_alpha=2000000.0: expected"),
        (4, 0, r"lora_alpha=0: expected"),
        (1 << 17, 8, r"r=131072: expected an integer 1 <= r <= 65536"),
        (4.0, 8, r"r=4.0: expected an integer"),
    ],
)
def test_values_beyond_finetune_lora_are_refused_by_key(r, alpha, says):
    with pytest.raises(ValueError, match=rf"adapter_config.json: {says}"):
        check_adapter_config({"peft_type": "LORA", "r": r, "lora_alpha": alpha}, Path("adapter_config.json"))
    assert check_adapter_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8}, Path("a.json")) == (4, 8.0)


def test_the_fused_rank_and_alpha_are_checked_too():
    assert our_lora_alpha(4, 8.0, 12, Path("a.json")) == 24.0  # fused q/k/v: rank 3r, PEFT's scale alpha / r kept
    with pytest.raises(ValueError, match=r"a.json: r=4, lora_alpha=900000 give finetune.lora.alpha=2.7e\+06"):
        our_lora_alpha(4, 9e5, 12, Path("a.json"))
    with pytest.raises(ValueError, match=r"give finetune.lora.rank=98304: expected an integer 1 <= rank <= 65536"):
        our_lora_alpha(32768, 8.0, 3 * 32768, Path("a.json"))


@pytest.mark.parametrize("alpha", ["1e400", "600000"])
def test_the_import_writes_nothing(tmp_path, alpha):
    from safetensors.torch import save_file

    from recipes.gpt.hf import import_adapter_from_hf

    folder = tmp_path / "adapter"
    folder.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    out = {"q_proj": hidden, "v_proj": config.get("num_key_value_heads", heads) * (hidden // heads)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, size in out.items():  # q and v: one LoRA of rank 2r
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}."
            tensors[prefix + "lora_A.weight"] = torch.randn(4, hidden)  # A of their own: not one shared A
            tensors[prefix + "lora_B.weight"] = torch.zeros(size, 4)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(f'{{"peft_type": "LORA", "r": 4, "lora_alpha": {alpha}}}')
    with pytest.raises(ValueError, match=r"adapter_config.json: .*nothing was imported"):
        import_adapter_from_hf(str(folder), str(TINY_LLAMA), str(tmp_path / "out.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
