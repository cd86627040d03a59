"""Commands as README.md, docs/gpt.md and docs/data.md print them, run in order the way a newcomer runs them, checked
against what the documents say happens (a documented command that misleads is a failing test). Only what the
documents leave to the reader is shortened: training.steps, validation and loader workers, which neither change
what a run trains nor which checkpoint folder it uses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from core.checkpointing.layout import complete_checkpoints
from core.distributed.launch import run_name
from tests.support.helpers import REPO, read_records, run_python, torchrun

SHORT = ["logger.progress_bar=never", "data.num_workers=0", "training.val_at_end=false"]


def _ok(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _run_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / ".hydra").is_dir())


@pytest.mark.slow
def test_readme_quick_start_then_the_shard_command_then_more_steps_then_predict(tmp_path):
    """README: `vit_sanity`, then its shard command: the shard run is a run of its own, in its own folder, said at its
    start (not "resuming from outputs/vit_sanity/checkpoints/step_300, but these settings
    differ"); `training.steps` raised continues the plain run in its run directory; predict.py finds its config in
    the checkpoint (no --config-name needed)."""
    def train(*overrides: str) -> str:
        return _ok(run_python(REPO / "train.py", "--config-name", "vit_sanity", *overrides, *SHORT, cwd=tmp_path))

    plain = tmp_path / "outputs" / "vit_sanity" / "checkpoints"
    plain_out = train("training.steps=2")
    (first_run,) = _run_dirs(plain.parent)
    shards = tmp_path / "digits_shards"
    _ok(run_python(REPO / "scripts" / "shard_images.py", "--root", REPO / "data" / "digits", "--out", shards,
                   "--samples-per-shard", "600", cwd=tmp_path))
    sharded = ["data=shards", f"data.root={shards}", "data.num_classes=10"]  # README's command
    out = train(*sharded, "training.steps=2")
    own = plain.parent / run_name(sharded)  # data.num_classes@10+data.root@%2F...%2Fdigits_shards+data@shards
    assert f"checkpoints: {own.relative_to(tmp_path)}/checkpoints, a run of its own" in out
    assert "resuming from" not in out and (own / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert "checkpoints: outputs/vit_sanity/checkpoints (vit_sanity's own folder: the same command again resumes the " \
           "run)" in plain_out
    (shard_run,) = _run_dirs(own)  # its run directory beside its checkpoints
    assert json.loads((own / "checkpoints" / "run.json").read_text())["run_dir"] == str(shard_run)
    out = train(*sharded, "training.steps=2")  # the same command again: its own run, resumed, nothing to do
    assert f"the checkpoint {own.relative_to(tmp_path)}/checkpoints/step_2 is at step 2 of 2: nothing left to do. To " \
           "train this run longer, raise training.steps" in out and "checkpoint.path=<a new folder>" in out
    # README: "with training.steps=600 it continues from step 300, in the same run directory".
    out = train("training.steps=3")
    assert "resumed from outputs/vit_sanity/checkpoints/step_2 (step 2" in out
    assert _run_dirs(plain.parent) == [first_run]
    assert [r["step"] for r in read_records(first_run) if "loss" in r and "split" not in r][-1] == 3
    # A resume with another data setting in a folder given explicitly stays refused, saying how to start a new run.
    proc = run_python(REPO / "train.py", "--config-name", "vit_sanity", *sharded, "training.steps=4",
                      f"checkpoint.path={plain}", *SHORT, cwd=tmp_path)
    assert proc.returncode == 2 and "give it a folder of its own: checkpoint.path=<a new folder>" in proc.stdout
    # README's predict command without --config-name: the checkpoint names its config.
    out = _ok(run_python(REPO / "predict.py", "checkpoint.init_from=outputs/vit_sanity/checkpoints",
                         "predict.split=val", cwd=tmp_path))
    assert "--config-name vit_sanity: the config outputs/vit_sanity/checkpoints/step_3 was trained with" in out
    assert "wrote 359 rows to" in out


@pytest.mark.slow
def test_gpt_md_tensor_parallel_after_gpt_sanity_trains_then_generate_without_a_config(tmp_path):
    """gpt.md: `gpt_sanity`, then `gpt_sanity distributed.tp=2`: the second trains (a run of its own), not "distributed.tp:
    1 -> 2 ... nothing left to do"; generate.py takes the config from the checkpoint."""
    _ok(run_python(REPO / "train.py", "--config-name", "gpt_sanity", "training.steps=1", *SHORT, cwd=tmp_path))
    proc = subprocess.run(torchrun(2, "train.py", "--config-name", "gpt_sanity", "distributed.tp=2", "training.steps=1",
                                   *SHORT), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = _ok(proc)
    assert "nothing left to do" not in out and "step 1 | loss" in out and "mesh dp_outer=1 x dp_shard=1 x tp=2" in out
    assert "checkpoints: outputs/gpt_sanity/distributed.tp@2/checkpoints, a run of its own" in out
    assert [p.name for p in complete_checkpoints(tmp_path / "outputs/gpt_sanity/distributed.tp@2/checkpoints")] == \
        ["step_1"]
    out = _ok(run_python(REPO / "generate.py", "checkpoint.init_from=outputs/gpt_sanity/distributed.tp@2/checkpoints",
                         'generate.prompt="The whale"', "generate.max_new_tokens=4", cwd=tmp_path))
    assert "--config-name gpt_sanity: the config outputs/gpt_sanity/distributed.tp@2/checkpoints/step_1 was trained " \
           "with" in out and "--- prompt 1 (length, 4 tokens)\nThe whale" in out


@pytest.mark.slow
def test_entry_points_without_a_config_answer_in_one_line(tmp_path):
    """`python train.py` alone, `--help`, and predict.py given no checkpoint: the configs to choose from, not a
    traceback, Hydra's struct errors or its schema names."""
    proc = run_python(REPO / "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "config error: train.py needs a config: --config-name <name>, one of esm2_150m, esm2_650m, esm2_8m, "
        "esm2_sanity, gpt_125m, gpt_1b, gpt_sanity, mnist_finetune, mnist_predict, mnist_pretrain, vit_base_patch16_224, "
        "vit_predict, vit_sanity"]
    proc = run_python(REPO / "train.py", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python train.py --config-name <name> [key=value ...]")
    assert "vit_sanity" in proc.stdout and "_schema" not in proc.stdout and "== Config ==" not in proc.stdout
    proc = run_python(REPO / "predict.py", "predict.split=val", cwd=tmp_path)
    assert proc.returncode == 2 and "(or checkpoint.init_from=<step folder" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_python(REPO / "predict.py", f"checkpoint.init_from={tmp_path}/model.pt", cwd=tmp_path)
    assert proc.stderr.strip().splitlines() == [f"config error: checkpoint.init_from={tmp_path}/model.pt: no such file "
                                                "or folder"] and proc.returncode == 2
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_another_recipes_data_and_an_unresolvable_value_are_one_line_config_errors(tmp_path):
    proc = run_python(REPO / "train.py", "--config-name", "vit_sanity", "data=moby_dick", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: data=moby_dick is data of the gpt recipe, but this config trains the vit recipe: choose "
        "data=<one of digits, imagefolder, shards, synthetic, tiny_imagenet>, or a config of the gpt recipe "
        "(--config-name)"]
    proc = run_python(REPO / "train.py", "--config-name", "vit_sanity", "checkpoint.path=${oc.env:NO_SUCH_VARIABLE}",
                      cwd=tmp_path, env={"PATH": "/usr/bin"})
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].endswith("config error: invalid config at 'checkpoint.path': KeyError raised while resolving "
                              "interpolation: \"Environment variable 'NO_SUCH_VARIABLE' not found\"")
