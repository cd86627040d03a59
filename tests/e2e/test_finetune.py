"""Fine-tuning runs (finetune.mode, core/training/finetune.py): the esm2_finetune recipe with LoRA and with a frozen
backbone stops and goes bit for bit on packed sequences and trains only what it should (the base weights bitwise
unchanged), and checkpoint.init_from=<a Hugging Face EsmForMaskedLM folder> gives the weights checkpoint.py from-hf
gives (on the pretraining recipe, esm2)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.checkpoint_harness import run_phases
from tests.support.helpers import run_workers

# A tiny ESM-2 (recipes/esm2's tiny_configs sizes) on the shipped sanity task, 2 ranks x 2 accumulation steps.
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "model.max_seq_length=64",  # longer sequences are cropped: a random window, from the data's RNG
    "model.backend=torch",
    "model.hidden_dropout=0.1",  # so the RNG state matters across the stop
    "data.tokens_per_pack=256",
    "data.max_sequences_per_pack=8",
    "training.steps=6",
    "training.global_batch_size=4",
    "training.micro_batch_size=1",
    "training.log_every_n_steps=1",
    "training.val_every_n_steps=0",
    "training.val_at_end=false",
    "scheduler.warmup_steps=2",
    "optim.lr=1e-2",
    "logger.progress_bar=never",
    "distributed=ddp",
]
# The pretraining recipe, its LM head standing in for a task head (init_from a Hugging Face folder).
TINY = [*SMALL, "finetune.head=[lm_head]"]
# Each mode on a task of its own: a pooled sequence head and the residue head; the head's dropout (its default, 0.1)
# draws from the RNG too.
FINETUNE = {
    "lora": ["model.task=classification", "data.label_columns=[charge_class]", "model.head_dropout=0.1"],
    "frozen": ["model.task=residue_classification", "data.label_columns=[structure]", "model.head_dropout=0.1"],
}


def _phase(tmp, name, ckpt, extra=(), config="esm2_sanity", **kw) -> dict:
    base = TINY if config == "esm2_sanity" else SMALL
    return {
        "config": config,
        "overrides": base + list(extra) + [f"checkpoint.path={tmp}/{ckpt}"],
        "run_dir": f"{tmp}/{name}",
        **kw,
    }


@pytest.mark.parametrize("mode", ["lora", "frozen"])
@pytest.mark.slow
def test_finetune_stops_and_goes_bitwise_and_trains_only_its_parameters(mode, tmp_path):
    extra = [f"finetune.mode={mode}", "finetune.lora.rank=4", "finetune.lora.dropout=0.1", *FINETUNE[mode]]
    ft = "esm2_finetune_sanity"
    ranks = run_workers(
        2,
        run_phases,
        [
            # the initial weights: a step of lr 1e-30 moves no weight (below every weight's last bit)
            _phase(tmp_path, "init", "ckpt_init", extra + ["training.steps=1", "optim.lr=1e-30"], ft, state=True),
            _phase(tmp_path, "ref", "ckpt_ref", extra, ft, state=True),
            _phase(tmp_path, "stopped", "ckpt", extra, ft, signal_at=3),
            _phase(tmp_path, "resumed", "ckpt", extra, ft, state=True),
        ],
    )
    init, ref, stopped, resumed = ranks[0]
    assert stopped["stopped_by"] == "SIGTERM" and max(stopped["losses"]) == 4 and resumed["start_step"] == 4
    assert stopped["losses"] | resumed["losses"] == ref["losses"] and sorted(ref["losses"]) == list(range(1, 7))
    assert all(torch.equal(ref["state"][k], resumed["state"][k]) for k in ref["state"])
    trained = {k for k in ref["state"] if not torch.equal(ref["state"][k], init["state"][k])}
    expected = {k for k in ref["state"] if k.startswith("head.") or (mode == "lora" and "lora_B" in k)}
    # lora_A moves too (its gradient is B^T-weighted: nonzero once B has left 0); every base weight stays put
    allowed = expected | {k for k in ref["state"] if "lora_A" in k}
    assert expected <= trained <= allowed, sorted(trained ^ expected)
    lora = [k for k in ref["state"] if "lora_" in k]
    assert (len(lora) == 2 * 2 * 2) if mode == "lora" else not lora  # A and B on layernorm_qkv and proj, 2 layers
    assert any(k.startswith("layers.") for k in ref["state"]) and not any(k.startswith("lm_head") for k in ref["state"])


def _tiny_hf_folder(tmp_path):
    from transformers import EsmConfig, EsmForMaskedLM

    from recipes.esm2 import hf as esm_hf
    from tests.support.helpers import validated_config

    m = validated_config("esm2_sanity", TINY + [f"checkpoint.path={tmp_path}/unused"]).model
    torch.manual_seed(3)
    model = EsmForMaskedLM(EsmConfig(**esm_hf.hf_config(m))).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


@pytest.mark.slow
def test_init_from_a_hugging_face_folder_equals_from_hf_then_init_from(tmp_path):
    from recipes.esm2.hf import import_from_hf

    folder = _tiny_hf_folder(tmp_path)
    assert not list(folder.glob("*.bin"))
    import_from_hf(str(folder), str(tmp_path / "imported.safetensors"))
    still = ["training.steps=1", "optim.lr=1e-30", "finetune.mode=lora"]
    ranks = run_workers(
        1,
        run_phases,
        [
            _phase(tmp_path, "hf", "c1", still + [f"checkpoint.init_from={folder}"], state=True),
            _phase(
                tmp_path, "file", "c2", still + [f"checkpoint.init_from={tmp_path}/imported.safetensors"], state=True
            ),
            _phase(
                tmp_path,
                "wrong",
                "c3",
                still + [f"checkpoint.init_from={folder}", "model.ffn_hidden_size=128"],
                expect_error=True,
            ),
        ],
    )
    from_folder, from_file, wrong = ranks[0]
    assert set(from_folder["state"]) == set(from_file["state"])
    assert all(torch.equal(from_folder["state"][k], from_file["state"][k]) for k in from_file["state"])
    hf_config = json.loads((folder / "config.json").read_text())
    assert from_folder["state"]["embedding.weight"].shape[1] == hf_config["hidden_size"]
    assert "model.ffn_hidden_size=128 (config.json: 64)" in wrong["error"]
