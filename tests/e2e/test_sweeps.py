"""Optuna sweeps: one sampler in the launching process proposes each trial's values, every trial trains and
returns training.objective, and the study's best is the best trial's own figure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from core.distributed.launch import configuration_name
from tests.support.helpers import REPO, read_records, run_python

TINY = [
    "data.num_workers=0",
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "training.steps=4",
    "training.global_batch_size=8",
    "training.micro_batch_size=8",
    "training.log_every_n_steps=1",
    "training.limit_val_batches=4",
    "logger.progress_bar=never",
]


def _sweep(tmp_path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_python(
        REPO / "train.py",
        "-m",
        "--config-name",
        "vit_sanity",
        *TINY,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *overrides,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_three_optuna_trials_run_and_report_their_objectives(tmp_path):
    proc = _sweep(
        tmp_path,
        "hydra/sweeper=optuna_objective",
        "hydra.sweeper.n_trials=3",
        "optim.lr=tag(log,interval(1e-4,1e-2))",
        "training.objective.metric=val/top1",
        "training.objective.direction=maximize",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    top1, lrs = {}, set()
    for job in ("0", "1", "2"):
        records = read_records(sweep / job)
        top1[job] = [r for r in records if r.get("split") == "val"][-1]["top1"]
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        lrs |= {o for o in overrides if "optim.lr" in o}
        # The default checkpoint root: each trial's own folder, named by its overrides.
        assert (sweep / "checkpoints" / configuration_name(overrides) / "step_4" / "COMPLETE").exists()
    assert not (sweep / "3").exists() and len(lrs) == 3  # three trials, each with the sampler's own lr
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(top1.values())  # maximize: the trials' own val/top1 reached the study
    assert results["best_params"]["optim.lr"] in {float(o.split("=")[1]) for o in lrs}
    assert "Directions: [<Direction.maximize" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        (
            ["hydra/sweeper=optuna", "training.objective.direction=maximize"],
            {},
            "hydra.sweeper.direction=minimize but training.objective.direction=maximize",
        ),
        (
            ["hydra/sweeper=optuna_objective", "hydra.sweeper.n_trials=1"],
            {"SLURM_NTASKS": "2"},
            "every rank would run its own sampler",
        ),
        (
            ["hydra/sweeper=optuna_objective", "hydra.sweeper.n_trials=1", "training.objective.metric=val/top9"],
            {},
            "training.objective.metric='val/top9' is not a metric of this run; there are: train/grad_norm, train/loss, "
            "train/lr, val/loss, val/top1, val/top5",
        ),
    ],
)
@pytest.mark.slow
def test_sweeps_that_cannot_work_are_refused(tmp_path, overrides, env, message):
    proc = _sweep(tmp_path, *overrides, env=env)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr[-3000:]


def test_the_objective_of_a_finished_run():
    import train

    result = train.RunResult(steps=4, train={"loss": 1.5, "lr": 0.1, "grad_norm": 2.0}, val={"loss": 1.2})
    assert train.objective(result, "train/loss") == 1.5 and train.objective(result, "val/loss") == 1.2
    unvalidated = train.RunResult(steps=4, train={"loss": 1.0})
    with pytest.raises(train.ConfigError, match="it has: none: val never ran"):
        train.objective(unvalidated, "val/loss")  # an Optuna trial needs it
    assert train.objective(unvalidated, "val/loss", required=False) is None  # a plain run does not


@pytest.mark.slow
def test_jobs_that_differ_only_in_a_swept_key_that_keeps_the_result_train_apart(tmp_path):
    """training.steps does not change the result (a resume may extend a run), so it did not name a job's folder:
    the steps=4 job of `training.steps=6,4` resumed the steps=6 job's step_6 and had nothing left to do. A swept
    key names each job's folder, so each trains its own length from scratch."""
    ckpts = tmp_path / "shared"
    tiny = [o for o in TINY if not o.startswith("training.steps=")]
    proc = run_python(
        REPO / "train.py",
        "-m",
        "--config-name",
        "vit_sanity",
        *tiny,
        "training.steps=6,4",
        f"checkpoint.path={ckpts}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "nothing left to do" not in out and "resumed from" not in out
    for job, steps in (("0", 6), ("1", 4)):
        overrides = yaml.safe_load((tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").read_text())
        folder = ckpts / configuration_name(overrides, {"training.steps"})
        assert f"training.steps={steps}" in folder.name
        assert sorted(p.name for p in folder.glob("step_*")) == [f"step_{steps}"], folder
        records = read_records(tmp_path / "sweep" / job)
        assert max(r["step"] for r in records if "split" not in r) == steps  # its own length, its own steps
    assert len(list(ckpts.iterdir())) == 2


def test_a_swept_key_names_the_folder_and_a_sweep_over_result_keys_keeps_its_names():
    job = ["model.hidden_size=32", "training.micro_batch_size=8", "logger.progress_bar=never"]
    # Not swept, training.steps and the micro-batch leave the name (a run again with other values resumes) ...
    assert (
        configuration_name([*job, "training.steps=6"])
        == configuration_name([*job, "training.steps=4"])
        == "model.hidden_size=32"
    )
    # ... swept, they name it, and only they: two jobs, two folders.
    assert configuration_name([*job, "training.steps=6"], {"training.steps"}) == "model.hidden_size=32,training.steps=6"
    assert (
        configuration_name([*job, "+training.steps=4"], {"training.steps", "training.micro_batch_size"})
        == "model.hidden_size=32,training.micro_batch_size=8,training.steps=4"
    )
    # A sweep over result-changing keys only is named as before: running it again resumes its jobs.
    assert configuration_name(["optim.lr=0.001", "training.steps=4"], {"optim.lr"}) == "optim.lr=0.001"


def test_the_swept_keys_are_read_from_the_command_line_and_the_sweeper(monkeypatch):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from core.distributed import launch

    argv = [
        "-m",
        "--config-name",
        "vit_sanity",
        "training.steps=6,4",
        "optim.lr=0.1",
        "+training.epochs=range(1,3)",
        "optim.weight_decay=tag(log,interval(1e-4,1e-2))",
        "model=vit_tiny,vit_base_patch16_224",
        "data.root='a,b'",
        "optim.betas=[0.9,0.95]",
        "hydra.sweeper.n_trials=3",
        "hydra.launcher.nodes=1,2",
        "model@x=a,b",
        "broken=[",
        "--config-dir=a=b",
    ]
    assert launch.swept_on_command_line(argv) == [
        "training.steps",
        "training.epochs",
        "optim.weight_decay",
        "model",
        "model@x",
    ]
    # The launching process hands them to its jobs (submitit's run in other processes, with other command lines).
    for name in ("PYTHONPATH", launch.RUN_ID_ENV, launch.SWEPT_KEYS_ENV):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(launch, "_RUN_ID", "run")
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    launch.export_to_jobs()
    monkeypatch.setattr(sys, "argv", ["submitit_job.py"])
    sweeper = OmegaConf.create({"sweeper": {"params": {"optim.lr": "interval(1e-4, 1e-2)"}}})  # Optuna's, in a config
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: sweeper))
    assert launch.swept_keys() == {
        "training.steps",
        "training.epochs",
        "optim.weight_decay",
        "model",
        "model@x",
        "optim.lr",
    }


@pytest.mark.slow
def test_a_failing_job_is_named_and_the_sweep_goes_on(tmp_path):
    """Job 1 of 3 has a config error: it is logged as its line, jobs 0 and 2 train to the end, and the multirun
    ends with job 1's exit code (2) and a list naming it with its overrides. (A job's error left through
    SystemExit, which ended the whole sweep at job 1: job 2 never ran.)"""
    proc = _sweep(tmp_path, "optim.lr=0.001,-1,0.002", "training.val_every_n_steps=0", "training.val_at_end=false")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    sweep = tmp_path / "sweep"
    for job, lr in (("0", "0.001"), ("2", "0.002")):
        assert max(r["step"] for r in read_records(sweep / job) if "split" not in r) == 4
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        assert (sweep / "checkpoints" / configuration_name(overrides) / "step_4" / "COMPLETE").exists()
    assert "config error: optim.lr=-1.0: expected 1e-30 <= lr <= 10" in out
    summary = proc.stderr[proc.stderr.index("multirun: 1 job(s) failed") :].splitlines()
    assert summary[1] == "  job 1 (optim.lr=-1): config error: optim.lr=-1.0: expected 1e-30 <= lr <= 10"
    assert not (sweep / "0" / "job_failed.json").exists() and (sweep / "1" / "job_failed.json").exists()
