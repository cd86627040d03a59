"""Launcher glue: SLURM variables become torch.distributed's, run ids agree across ranks, SLURM launcher config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.support.helpers import CONFIGS, REPO, run_python

SLURM_RANK_3_OF_4 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
PROBE = """
import json, os
from core.distributed.env import _export_slurm_env_if_needed
from core.distributed import launch
_export_slurm_env_if_needed()
print(json.dumps({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
                 | {"run_id": launch.run_id(), "rank": launch.global_rank()}))
"""


def probe(env: dict) -> dict:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_slurm_task_gets_torch_distributed_variables():
    got = probe(SLURM_RANK_3_OF_4)
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["MASTER_ADDR"]) == ("3", "4", "1", "gpu07")
    assert got["MASTER_PORT"].isdigit()
    assert got["run_id"] == "slurm-4242" and got["rank"] == 3


def test_torchrun_rendezvous_id_names_the_run_without_agent_store():
    got = probe(
        {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    )
    assert got["run_id"] == "exp7" and got["rank"] == 1


def test_the_slurm_launcher_asks_slurm_for_the_job_the_readme_describes(tmp_path, monkeypatch):
    """hydra/launcher=slurm, as docs/clusters.md's command gives it, composed and handed to the plugin: the batch script
    that submitit would submit (stopped before sbatch) asks for the nodes, one task per GPU, the partition, the
    time limit and the warning signal the loop saves on; a key of the YAML that the plugin or submitit does not
    take would fail here."""
    import submitit
    from hydra.core.utils import JobReturn
    from hydra.types import HydraContext
    from hydra.utils import instantiate

    from tests.support.helpers import register

    class Submitted(Exception):
        pass

    script = {}

    def map_array(executor, fn, *args):
        script["text"] = executor._executor._make_submission_file_text("python train.py", "0")
        script["requeues"] = executor._executor.max_num_timeout
        raise Submitted

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            config_name="vit_base_patch16_224",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.nodes=2",
                "hydra.launcher.partition=gpu",
                f"hydra.sweep.dir={tmp_path}",
                "distributed.dp_shard=16",
            ],
        )
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    fake_bin = tmp_path / "bin"  # submitit looks for srun before it writes anything
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(
        hydra_context=HydraContext(config_loader=None, callbacks=None), task_function=lambda c: JobReturn(), config=cfg
    )
    with pytest.raises(Submitted):
        launcher.launch([["optim.lr=1e-3"]], initial_job_idx=0)
    directives = {line.split()[1] for line in script["text"].splitlines() if line.startswith("#SBATCH ")}
    for wanted in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=12",
        "--time=240",
        "--partition=gpu",
        "--signal=USR2@120",
        "--job-name=vit_base_patch16_224",
    ):
        assert wanted in directives, (wanted, sorted(directives))
    assert script["requeues"] == 20  # submitit requeues the job itself on the signal, this many times


def test_a_misplaced_or_misspelt_key_gets_the_key_that_exists(tmp_path):
    """BioNeMo's ViT command says training.checkpoint.path; ours is checkpoint.path. The answer comes before
    Hydra composes (Hydra would advise `+training.checkpoint.path`, which the schema then refuses)."""
    from core.config.overrides import suggestion
    from recipes.registry import config_keys

    keys = config_keys()
    assert suggestion("training.checkpoint.path", keys) == "checkpoint.path"
    assert suggestion("trainig.steps", keys) == "training.steps"
    assert suggestion("model.hiden_size", keys) == "model.hidden_size"
    assert suggestion("training.lr", keys) == "optim.lr"
    assert suggestion("data.num_worker", keys) == "data.num_workers"
    # Matched against the keys of the recipe the command line runs: ESM-2's token_dropout is not the ViT's.
    assert suggestion("model.dropout", config_keys(["--config-name", "vit_sanity"])) == "model.hidden_dropout"
    assert suggestion("model.dropout", config_keys(["--config-name=esm2_sanity"])) == "model.token_dropout"
    assert suggestion("model.dropout", config_keys(["-cn", "esm2_sanity", "recipe=gpt"])) == "model.hidden_dropout"
    assert "data.tokens_per_pack" not in config_keys(["--config-name", "gpt_sanity"])
    assert "data.tokens_per_pack" in config_keys(["--config-name", "no_such_config"])  # unknown: every recipe's
    proc = run_python(
        REPO / "train.py",
        "--config-name",
        "vit_sanity",
        "training.checkpoint.path=ckpts/vit",
        "distributed.dp_shard=1",
        "model=vit_tiny",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown key 'training.checkpoint.path'; did you mean 'checkpoint.path'?" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing was started


class _Mesh:
    """What env.setup asks of a device mesh."""

    def __getitem__(self, dims):
        return self

    def _flatten(self, name):
        return self


def test_only_a_processs_first_nccl_world_is_bound_to_its_device(monkeypatch):
    """A later job in the same processes (a multirun's next) starts its NCCL world without device_id: torch's NCCL
    crashed (SIGSEGV) splitting a device-bound world that was not the process's first into the mesh's groups
    (benchmarks/results/2026-11-27-two-gpus-suite-h200x2/; on GPUs: tests/gpu/test_te_and_megatron_fsdp.py's 2-GPU
    multirun)."""
    import torch

    from core.distributed import env

    bound = []
    monkeypatch.setattr(env, "_DEVICE_BOUND_WORLD_STARTED", False)
    monkeypatch.setattr(env, "_job_store", lambda *args: None)
    monkeypatch.setattr(env, "init_device_mesh", lambda *args, **kwargs: _Mesh())
    monkeypatch.setattr(env.torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(env.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(env.dist, "init_process_group", lambda *args, **kwargs: bound.append(kwargs["device_id"]))
    for device_type in ("cpu", "cuda", "cuda", "cuda"):  # jobs one after another in one process
        env.setup(1, 1, 1, 1.0, device_type)
    assert bound == [None, torch.device("cuda", 0), None, None]
