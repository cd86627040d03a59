"""Checkpoints as shared between people and clusters: loading runs no code from them, damaged files are
caught, one run writes to a path at a time, folders this tool did not write are left alone, and a resumed
run keeps the settings that make its result (or takes new ones only when told to, and then really)."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

import checkpoint
import predict
from core.checkpointing.layout import CheckpointError, write_marker
from core.checkpointing.lock import PathLock
from core.config.errors import ConfigError
from core.distributed.launch import configuration_name, run_name
from core.training.optim import lr_multiplier
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import REPO, read_records, run_python, train_run, validated_config


def _train(tmp_path: Path, name: str, overrides: list[str]) -> dict:
    cfg = validated_config("vit_sanity", TINY + [f"checkpoint.path={tmp_path}/ckpt"] + overrides)
    return train_run(cfg, tmp_path / name)


def _log(tmp_path: Path, name: str) -> list[dict]:
    return read_records(tmp_path / name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint root with step_2 and step_4 of a tiny run."""
    tmp = tmp_path_factory.mktemp("trained")
    _train(tmp, "run", ["training.steps=4", "checkpoint.save_every_n_steps=2"])
    return tmp / "ckpt"


# ----------------------------------------------------------------------------- no code runs from a checkpoint


class _Payload:
    """Unpickling it writes `marker`, then returns `result` (a pickle of the real object), so a loader
    that runs it carries on as if nothing happened."""

    def __init__(self, marker: Path, result: bytes):
        self.marker, self.result = str(marker), result

    def __reduce__(self):
        return eval, (f"(open({self.marker!r}, 'w').write('ran'), __import__('pickle').loads({self.result!r}))[1]",)


def _with_payload_in_metadata(source: Path, target: Path, marker: Path) -> Path:
    shutil.copytree(source, target)
    real = (target / ".metadata").read_bytes()
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(marker, real)))
    (target / "COMPLETE").unlink()
    (target / "index.json").unlink(missing_ok=True)  # the pickle index is read
    write_marker(target, {"step": 4, "metrics": {}})  # an attacker makes the marker match
    return target


def _with_build_on_a_class_in_metadata(source: Path, target: Path, marker: Path) -> Path:
    """The index with a pickle BUILD that patches `PosixPath.is_file` (allowed names only): a plain or allow-list
    unpickler would change the process and carry on."""
    from tests.unit.checkpointing.test_restricted_unpickling import _crafted_metadata, tricks

    shutil.copytree(source, target)
    (target / ".metadata").write_bytes(_crafted_metadata(source, tricks(marker)["BUILD on a class"]))
    (target / "COMPLETE").unlink()
    (target / "index.json").unlink(missing_ok=True)  # the pickle index is read
    write_marker(target, {"step": 4, "metrics": {}})
    return target


def _with_payload_in_a_value(source: Path, target: Path, marker: Path) -> Path:
    """A plain DCP save (as anyone can write) whose train_state.step is a pickled payload."""
    from core.checkpointing.weights import read_model_weights

    weights = read_model_weights(source)
    dcp.save(
        {"model": weights, "train_state": {"step": _Payload(marker, pickle.dumps(4))}},
        checkpoint_id=str(target),
        no_dist=True,
    )
    shutil.copy(source / "config.yaml", target / "config.yaml")
    write_marker(target, {"step": 4, "metrics": {}})
    return target


@pytest.mark.parametrize(
    "craft",
    [_with_payload_in_metadata, _with_build_on_a_class_in_metadata, _with_payload_in_a_value],
    ids=["metadata", "metadata-build", "value"],
)
@pytest.mark.slow
def test_no_load_path_runs_code_from_a_checkpoint(trained, tmp_path, craft):
    marker = tmp_path / "payload_ran"
    is_file = pathlib.PosixPath.is_file
    root = tmp_path / "shared"
    evil = craft(trained / "step_4", root / "step_4", marker)
    attempts = {
        "auto-resume": lambda: _train(tmp_path, "auto", [f"checkpoint.path={root}", "training.steps=6"]),
        "resume=<dir>": lambda: _train(tmp_path, "explicit", [f"checkpoint.resume={evil}", "training.steps=6"]),
        "init_from": lambda: _train(tmp_path, "init", [f"checkpoint.init_from={evil}"]),
        "predict.py": lambda: predict.predict(
            validated_config(
                "vit_predict",
                [
                    "data=synthetic",
                    "data.num_workers=0",
                    "model.backend=torch",
                    "precision=fp32",
                    f"checkpoint.init_from={evil}",
                    f"checkpoint.path={tmp_path}/unused",
                ],
            ),
            tmp_path / "predict",
        ),
        "to-torch": lambda: checkpoint.main(["to-torch", str(evil), str(tmp_path / "w.pt")]),
        "to-safetensors": lambda: checkpoint.main(["to-safetensors", str(evil), str(tmp_path / "w.safetensors")]),
    }
    for name, attempt in attempts.items():
        if craft is _with_payload_in_a_value and name not in ("auto-resume", "resume=<dir>"):
            try:
                attempt()  # weights only: the crafted value is never read
            except ConfigError as e:  # (predict.py, after loading the weights: synthetic data has no split)
                assert name == "predict.py" and "synthetic" in str(e), (name, str(e))
        else:
            with pytest.raises((CheckpointError, SystemExit)) as error:
                attempt()
            assert "refusing to load" in str(error.value), (name, str(error.value))
            assert str(evil) in str(error.value), name  # names the checkpoint
        assert not marker.exists(), f"{name} ran the checkpoint's code"
        assert pathlib.PosixPath.is_file is is_file, f"{name} let the checkpoint patch a class"


# ----------------------------------------------------------------------------- damaged files


def _flip_a_bit(step_dir: Path, position=lambda data: len(data) // 2, mask: int = 0x10) -> Path:
    """A bit of the first shard flipped (in its middle by default); that shard."""
    shard = sorted(step_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[position(data)] ^= mask
    shard.write_bytes(bytes(data))
    return shard


def test_a_flipped_bit_is_caught(trained, tmp_path, caplog):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    shard = _flip_a_bit(root / "step_4")
    # Automatic resume skips it, naming the file, and resumes from the checkpoint before.
    with caplog.at_level("WARNING"):
        result = _train(tmp_path, "auto", ["training.steps=5"])["result"]
    assert result.resumed_from == str(root / "step_2")
    assert str(shard) in caplog.text and "checksum mismatch" in caplog.text
    # An explicit choice stops with the error; so does conversion, unless told to skip the check.
    shutil.copytree(trained / "step_4", tmp_path / "explicit" / "step_4")
    shard = _flip_a_bit(tmp_path / "explicit" / "step_4")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _train(
            tmp_path,
            "explicit",
            [f"checkpoint.resume={shard.parent}", f"checkpoint.path={tmp_path}/other", "training.steps=6"],
        )
    with pytest.raises(SystemExit, match=str(shard)):
        checkpoint.main(["to-torch", str(shard.parent), str(tmp_path / "w.pt")])
    checkpoint.main(["to-torch", str(shard.parent), str(tmp_path / "w.pt"), "--skip-checksums"])


def _flip_the_zip_version(step_dir: Path) -> Path:
    """One flipped bit that zipfile does not take for damage: the zip version the first central-directory record
    of a shard needs (torch writes 45) becomes 109, above any Python reads (NotImplementedError, not BadZipFile)."""
    return _flip_a_bit(step_dir, lambda data: data.index(b"PK\x01\x02") + 6, 0x40)


def test_a_flipped_bit_in_a_zip_header_is_one_line_and_resume_falls_back(trained, tmp_path, caplog):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    shard = _flip_the_zip_version(root / "step_4")
    for skip in ([], ["--skip-checksums"]):
        proc = run_python(REPO / "checkpoint.py", "to-torch", root / "step_4", tmp_path / "w.pt", *skip, cwd=tmp_path)
        assert proc.returncode == 3 and proc.stderr.startswith(f"error: {shard}: "), proc.stderr[-3000:]
        assert "zip file version" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with caplog.at_level("WARNING"):
        result = _train(tmp_path, "auto", ["training.steps=5"])["result"]
    assert result.resumed_from == str(root / "step_2")
    assert f"cannot resume from {root / 'step_4'}: {shard}: " in caplog.text


# ----------------------------------------------------------------------------- one writer per path


def test_a_second_run_on_a_locked_path_stops_at_start(tmp_path):
    """A live run holds the path (here: a process on this host that is alive); a second run stops before
    any work, naming the holder. Once the holder is gone its lock is stale and taken over."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "LOCK").write_text(
            json.dumps({"host": os.uname().nodename, "pid": holder.pid, "job": None, "since": 0})
        )
        with pytest.raises(ConfigError, match=f"in use by another run .*pid {holder.pid}"):
            _train(tmp_path, "second", ["training.steps=2"])
        assert not (tmp_path / "second" / "metrics.jsonl").exists() and not list((tmp_path / "ckpt").glob("step_*"))
    finally:
        holder.kill()
        holder.wait()
    _train(tmp_path, "after", ["training.steps=2"])  # the holder died: its lock is stale
    assert (tmp_path / "ckpt" / "step_2" / "COMPLETE").exists() and not (tmp_path / "ckpt" / "LOCK").exists()


def test_a_lock_refreshed_from_another_host_is_respected(tmp_path):
    lock = tmp_path / "LOCK"
    lock.write_text(json.dumps({"host": "some-other-node", "pid": 1, "job": "slurm 1.0", "since": 0}))
    with pytest.raises(RuntimeError, match="some-other-node"):
        PathLock(tmp_path).acquire()
    os.utime(lock, (1, 1))  # not refreshed for decades: its run is gone
    taken = PathLock(tmp_path)
    taken.acquire()
    taken.release()
    assert not lock.exists()


def test_unrelated_folders_survive(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_999").mkdir(parents=True)
    (ckpt / "step_999" / "notes.txt").write_text("mine")
    (ckpt / "step_3").mkdir()  # looks like an interrupted save, but this tool did not start it
    (ckpt / "step_3" / "data.bin").write_bytes(b"x")
    _train(tmp_path, "run", ["training.steps=4", "checkpoint.save_every_n_steps=2", "checkpoint.keep_last_n=1"])
    _train(tmp_path, "again", ["training.steps=4", "checkpoint.resume=false", "checkpoint.overwrite=true"])
    assert (ckpt / "step_999" / "notes.txt").read_text() == "mine" and (ckpt / "step_3" / "data.bin").exists()
    assert (ckpt / "step_4" / "COMPLETE").exists() and not (ckpt / "step_2").exists()


def test_an_unwritable_checkpoint_path_stops_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        _train(tmp_path, "run", [f"checkpoint.path={tmp_path}/a_file/ckpt"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- resumed settings


def test_a_changed_learning_rate_is_refused_or_really_used(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.003 -> 0\.001") as error:
        _train(tmp_path, "refused", ["training.steps=6", "optim.lr=1e-3"])
    assert "checkpoint.allow_config_changes=true" in str(error.value)
    assert not (tmp_path / "ckpt" / "step_6").exists()
    # Extending training.steps alone is fine; with the allow option the new rate is the one in effect.
    _train(tmp_path, "allowed", ["training.steps=6", "optim.lr=1e-3", "checkpoint.allow_config_changes=true"])
    cfg = validated_config("vit_sanity", TINY + ["training.steps=6", f"checkpoint.path={tmp_path}/unused"])
    logged = {r["step"]: r["lr"] for r in _log(tmp_path, "allowed") if "lr" in r}
    for step in (5, 6):
        assert logged[step] == pytest.approx(1e-3 * lr_multiplier(step - 1, 6, cfg.scheduler), rel=1e-12)
    saved = (tmp_path / "ckpt" / "step_6" / "config.yaml").read_text()
    assert "lr: 0.001" in saved


def test_a_fallback_resume_compares_the_settings_of_the_checkpoint_it_loads(trained, tmp_path, caplog):
    """Automatic resume past a damaged newest checkpoint compares the run's settings with the config.yaml of the
    one it falls back to (here trained with another learning rate), not only with the newest's."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    config = root / "step_2" / "config.yaml"
    assert "lr: 0.003" in config.read_text()
    config.write_text(config.read_text().replace("lr: 0.003", "lr: 0.002", 1))
    marker = json.loads((root / "step_2" / "COMPLETE").read_text())
    (root / "step_2" / "COMPLETE").unlink()
    write_marker(root / "step_2", {k: v for k, v in marker.items() if k != "files"})
    shard = sorted((root / "step_4").glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ConfigError, match=rf"(?s)resuming from {root / 'step_2'}, but .*optim\.lr: 0\.002 -> 0\.003"):
        _train(tmp_path, "refused", ["training.steps=5"])
    with caplog.at_level("WARNING"):
        result = _train(tmp_path, "allowed", ["training.steps=5", "checkpoint.allow_config_changes=true"])["result"]
    assert result.resumed_from == str(root / "step_2")
    assert f"resuming from {root / 'step_2'} with changed settings" in caplog.text and "optim.lr: 0.002" in caplog.text


@pytest.mark.slow
def test_a_sweep_run_again_resumes_each_configurations_own_job(tmp_path):
    """With checkpoint.path given (e.g. on a shared filesystem), as under the default root <sweep dir>/checkpoints
    (test_sweeps.py), each job's checkpoints go to its configuration's folder, so both jobs train and a sweep run
    again resumes each configuration's own job."""
    ckpts = tmp_path / "shared"

    def sweep(values: str, steps: int) -> str:
        proc = run_python(
            REPO / "train.py",
            "--config-name",
            "vit_sanity",
            "-m",
            *TINY,
            f"optim.lr={values}",
            f"training.steps={steps}",
            f"hydra.sweep.dir={tmp_path}/sweep",
            f"checkpoint.path={ckpts}",
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    first = sweep("0.003,0.001", 2)
    out = sweep("0.0001,0.001", 4)
    assert not (tmp_path / "sweep" / "checkpoints").exists()
    folder = {}  # lr -> its configuration's folder
    for path in ckpts.iterdir():
        lrs = {OmegaConf.load(step / "config.yaml").optim.lr for step in path.glob("step_*")}
        assert len(lrs) == 1, path
        folder[str(lrs.pop())] = path.name
    assert sorted(folder) == ["0.0001", "0.001", "0.003"]
    logged = [
        line.split("this job's checkpoints: ")[1].split()[0]
        for line in first.splitlines()
        if "this job's checkpoints: " in line
    ]
    assert logged == [str(ckpts / folder["0.003"]), str(ckpts / folder["0.001"])]  # the log says where each job's go
    assert f"resumed from {ckpts / folder['0.001'] / 'step_2'}" in out
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert resumed and all(folder["0.001"] in line for line in resumed)  # lr=0.0001 started fresh, not from job 0's
    assert (ckpts / folder["0.0001"] / "step_4" / "COMPLETE").exists()
    assert (ckpts / folder["0.003"] / "step_2" / "COMPLETE").exists()


def test_configuration_names():
    assert (
        configuration_name(["optim.lr=1e-3", "training.steps=80", "seed=2", "logger.wandb.enabled=true"])
        == "optim.lr=1e-3,seed=2"
    )
    assert configuration_name(["training.steps=80"]) == "default"
    assert configuration_name(["data.root=/a/b", "model=vit_base"]) == "data.root=%2Fa%2Fb,model=vit_base"
    assert (
        configuration_name(["optim.betas=[0.9,0.95]", "+model.depth=-1"]) == "model.depth=-1,optim.betas=[0.9%2C0.95]"
    )
    # Overrides that differ give folders that differ: no character of a value passes for another, or for the
    # comma between overrides, and a name shortened with a hash is longer than any name kept whole.
    different = [
        ["data.root=a/b"],
        ["data.root=a_b"],
        ["data.root=a\\b"],
        ["data.root=a\x00b"],
        ["data.root=a%2Fb"],
        ["data.root=a%252Fb"],
        ["data.root=a,b"],
        ["data.root=a%2Cb"],
        ["data.root=x,data.split=y"],
        ["data.root=x", "data.split=y"],
        ["data.root=a b"],
        ["data.root=a:b"],
        ["data.root=é"],
        ["data.root=%C3%A9"],
    ]
    names = [configuration_name(overrides) for overrides in different]
    assert len(set(names)) == len(names), names
    for name in names:
        assert not {"/", "\\", "\x00", " ", ":"} & set(name) and name == name.encode("ascii").decode(), name
    long = configuration_name([f"model.layer_{i}=123456789" for i in range(30)])
    assert len(long) == 121 and long != configuration_name([f"model.layer_{i}=123456780" for i in range(30)])
    kept = "data.root=" + "a" * 110  # 120 characters: kept whole
    assert configuration_name([kept]) == kept and len(configuration_name([kept + "a"])) == 121


def test_a_single_runs_default_folder_is_named_by_the_overrides_that_make_another_run():
    """outputs/<config>/checkpoints for the config as it is, also extended (training.steps) or run with other
    logging, saving or speed settings; outputs/<config>/<name>/checkpoints for one that changes the model, data,
    optimization, parallel layout or starting weights: gpt.md's `distributed.tp=2` after `gpt_sanity` and the
    README's shard command after `vit_sanity` are runs of their own. The name can be given back on a command line
    unquoted (checkpoint.init_from=outputs/gpt_sanity/distributed.tp@2/checkpoints)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for same_run in (
        ["training.steps=600"],
        ["training.steps=600", "scheduler.on_extend=hold"],
        [
            "logger.progress_bar=never",
            "data.num_workers=0",
            "model.backend=torch",
            "checkpoint.save_every_n_steps=5",
            "checkpoint.keep_last_n=2",
            "training.micro_batch_size=4",
        ],
    ):
        assert run_name(same_run) is None, same_run
    assert run_name(["distributed.tp=2"]) == "distributed.tp@2"
    assert run_name(["distributed=ddp", "training.steps=9"]) == "distributed@ddp"
    assert (
        run_name(["data=shards", "data.root=/tmp/digits_shards", "data.num_classes=10", "training.steps=20"])
        == "data.num_classes@10+data.root@%2Ftmp%2Fdigits_shards+data@shards"
    )
    assert (
        run_name(["data.format=shards", "data.root=/tmp/digits_shards"])
        == "data.format@shards+data.root@%2Ftmp%2Fdigits_shards"
    )  # docs/data.md's
    assert run_name(["checkpoint.init_from=ckpt/pre/step_3000"]) == "checkpoint.init_from@ckpt%2Fpre%2Fstep_3000"
    assert run_name(["optim.lr=1e-3", "+seed=2", "scheduler=wsd", "seed=3"]) == "optim.lr@1e-3+scheduler@wsd+seed@3"
    different = [
        ["data.root=a/b"],
        ["data.root=a@b"],
        ["data.root=a+b"],
        ["data.root=a%2Fb"],
        ["data.root=a~b"],
        ["data.root=a=b"],
        ["data.root=x", "data.split=y"],
        ["data.root=x+data.split@y"],
        ["data.root=[1,2]"],
    ]
    names = [run_name(overrides) for overrides in different]
    assert len(set(names)) == len(names), names
    parser = OverridesParser.create()
    for name in names:
        assert (
            parser.parse_override(f"checkpoint.init_from=outputs/x/{name}/checkpoints").value()
            == f"outputs/x/{name}/checkpoints"
        )
    assert len(run_name([f"model.layer_{i}=123456789" for i in range(30)])) == 121
    # A sweep's folders keep their names (result-changing and swept keys only).
    assert configuration_name(["distributed.tp=2", "optim.lr=1e-3"]) == "optim.lr=1e-3"
