"""Every file checkpoint.py and a training's checkpoint writer create has the permissions the process's umask
gives a new file (0644 under umask 022), weight files written whole (a temporary file renamed into place); and
to-hf names the recipes it exports (derived from the code); the temporary file is one no one else could have
planted."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

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


def _saved(suffix: str, weights: dict, target: Path) -> dict:
    """`weights` written as a weight file by the checkpoint tools' writer for `suffix`, and read back."""
    from safetensors.torch import load_file

    from core.checkpointing.output_files import save_safetensors, save_torch

    if suffix == ".pt":
        save_torch(weights, target)
        return torch.load(target, weights_only=True)
    save_safetensors(weights, target)
    return load_file(str(target))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_link_planted_at_a_predictable_temporary_name_is_never_followed(tmp_path, suffix):
    """Someone who may write to the output folder plants `.<name>.tmp-<pid>` (the name the writer once used) as a
    link to the user's file: the file is neither overwritten nor given the output's mode, and the output is a file
    of its own with the umask's mode."""
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / f"model{suffix}"
    planted = shared / f".{target.name}.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    previous = os.umask(0o027)
    try:
        loaded = _saved(suffix, {"w": torch.ones(3)}, target)
    finally:
        os.umask(previous)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not target.is_symlink() and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert torch.equal(loaded["w"], torch.ones(3))
    assert sorted(p.name for p in shared.iterdir()) == sorted([planted.name, target.name])  # no temporary left


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot be saved")

    target = tmp_path / "model.pt"
    _saved(".pt", {"w": torch.ones(3)}, target)
    with pytest.raises(RuntimeError, match="cannot be saved"):
        _saved(".pt", {"w": torch.zeros(3), "x": Unsaveable()}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))


def test_tensors_sharing_memory_are_written_to_safetensors_as_copies(tmp_path):
    """A tied embedding and head read from a pytorch_model.bin are one storage, which safetensors refuses to write."""
    from safetensors.torch import load_file

    from core.checkpointing.output_files import save_safetensors

    embedding = torch.arange(6.0).reshape(3, 2)
    rows = torch.arange(8.0)
    tensors = {"embed": embedding, "head": embedding, "first": rows[:4], "last": rows[4:], "none": torch.empty(0)}
    save_safetensors(tensors, tmp_path / "w.safetensors")
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
