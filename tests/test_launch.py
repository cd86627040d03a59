"""Launcher glue: SLURM variables become torch.distributed's, run ids agree across ranks, SLURM launcher config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hydra import compose, initialize_config_dir

from tests.helpers import CONFIGS, REPO

SLURM_RANK_3_OF_4 = {
    "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
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
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_slurm_task_gets_torch_distributed_variables():
    got = probe(SLURM_RANK_3_OF_4)
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["MASTER_ADDR"]) == ("3", "4", "1", "gpu07")
    assert got["MASTER_PORT"].isdigit()
    assert got["run_id"] == "slurm-4242" and got["rank"] == 3


def test_torchrun_rendezvous_id_names_the_run_without_agent_store():
    got = probe({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert got["run_id"] == "exp7" and got["rank"] == 1


def test_slurm_launcher_config_composes():
    from tests.helpers import register

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="vit_base_patch16_224", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.partition=gpu"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.partition) == (2, 8, 8, "gpu")


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
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config-name", "vit_sanity",
                           "training.checkpoint.path=ckpts/vit", "distributed.dp_shard=1", "model=vit_tiny"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown key 'training.checkpoint.path'; did you mean 'checkpoint.path'?" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing was started
