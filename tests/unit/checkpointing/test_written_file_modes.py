"""Every file checkpoint.py and a training's checkpoint writer create has the permissions the process's umask
gives a new file (0644 under umask 022), weight files written whole (a temporary file renamed into place); and
to-hf names the recipes it exports (derived from the code)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from checkpoint import main as checkpoint_cli
from tests.support.helpers import train_run, validated_config

TINY = {
    "gpt": (
        "gpt_sanity",
        [
            "data.cache_dir={tmp}/cache",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_attention_heads=2",
            "model.num_query_groups=2",
            "model.ffn_hidden_size=64",
            "model.seq_length=32",
        ],
    ),
    "esm2": (
        "esm2_sanity",
        [
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            "model.ffn_hidden_size=64",
            "model.max_seq_length=64",
            "data.tokens_per_pack=256",
        ],
    ),
}


def test_to_hf_names_every_recipe_it_exports(tmp_path):
    for recipe in ("vit", "mnist"):
        step = tmp_path / recipe / "step_1"
        step.mkdir(parents=True)
        (step / "config.yaml").write_text(f"recipe: {recipe}\n")
        with pytest.raises(SystemExit) as stopped:
            checkpoint_cli(["to-hf", str(step), str(tmp_path / f"{recipe}_hf")])
        assert str(stopped.value) == (
            f"error: {step}: a checkpoint of the {recipe} recipe; to-hf exports those of the esm2, esm2_finetune and "
            "gpt recipes"
        )
        assert not (tmp_path / f"{recipe}_hf").exists()
    from recipes.registry import hf_conversions

    assert set(hf_conversions()) == {"gpt", "esm2", "esm2_finetune"}  # the recipes with recipes/<name>/hf.py


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("mask", [0o022, 0o002, 0o027])
def test_every_file_written_has_the_umasks_mode(tmp_path, mask):
    previous = os.umask(mask)
    try:
        steps = {}
        for recipe, (config, model) in TINY.items():
            train_run(
                validated_config(
                    config,
                    [
                        *(o.format(tmp=tmp_path) for o in model),
                        "training.steps=1",
                        "training.global_batch_size=4",
                        "training.micro_batch_size=4",
                        "training.val_every_n_steps=0",
                        "training.val_at_end=false",
                        "data.num_workers=0",
                        "logger.progress_bar=never",
                        f"checkpoint.path={tmp_path}/out/{recipe}_ckpt",
                    ],
                ),
                tmp_path / f"{recipe}_run",
            )
            steps[recipe] = tmp_path / "out" / f"{recipe}_ckpt" / "step_1"
        out = tmp_path / "out"
        for command in (
            ["to-torch", steps["gpt"], out / "gpt.pt"],
            ["to-safetensors", steps["gpt"], out / "gpt.safetensors"],
            ["from-torch", out / "gpt.pt", out / "from_torch" / "step_0"],
            ["to-hf", steps["gpt"], out / "gpt_hf"],
            ["to-hf", steps["esm2"], out / "esm2_hf"],
            ["from-hf", out / "gpt_hf", out / "from_hf.safetensors"],
            ["from-hf", out / "gpt_hf", out / "from_hf.pt"],
            ["from-hf", out / "esm2_hf", out / "from_hf_esm2.safetensors"],
            ["from-hf", out / "esm2_hf", out / "from_hf" / "step_0"],
        ):
            checkpoint_cli([str(part) for part in command])
    finally:
        os.umask(previous)
    modes = _modes(tmp_path / "out")
    assert {
        "gpt_hf/model.safetensors",
        "esm2_hf/model.safetensors",
        "gpt.safetensors",
        "from_hf.safetensors",
        "gpt_ckpt/step_1/__0_0.distcp",
        "gpt_ckpt/step_1/COMPLETE",
    } <= set(modes)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != 0o666 & ~mask}
    assert not wrong, f"umask {oct(mask)}: expected {oct(0o666 & ~mask)}, got {wrong}"
    assert not [p for p in (tmp_path / "out").rglob(".*.tmp-*")]  # no temporary file left
