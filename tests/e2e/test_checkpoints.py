"""Checkpoints: never lost or half-used (signals, kill -9, corruption, full disks), retention, async
saves, weights-only starts, and conversion to and from plain torch / safetensors files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint import format_utils

from core.checkpointing.layout import complete_checkpoints, step_dirs, verify
from core.checkpointing.retention import checkpoints_to_keep
from core.distributed.launch import run_name
from core.training.callbacks import Callback
from tests.support.checkpoint_harness import TINY, phase, run_phases, train_losses
from tests.support.helpers import REPO, _worker, free_port, read_records, run_python, run_workers, torchrun

# ----------------------------------------------------------------------------- real signals and kill -9


def _start(args: list[str], cwd: Path, run_dir: str) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        torchrun(2, "train.py", "--config-name", "vit_sanity", *args, f"hydra.run.dir={run_dir}"),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before the test could interrupt it:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def _kill9_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (which run in process groups of their own), like a node failure."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, pids = [proc.pid], []
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    return out


@pytest.mark.slow
def test_sigterm_and_kill9_then_the_same_command_resumes_exactly(tmp_path):
    """torchrun with 2 processes and the default checkpoint.path (outputs/<config>/<the overrides that make it a run of
    its own>/checkpoints): SIGTERM to torchrun saves and stops; kill -9 right after a save loses only the steps
    since. Running the same command again continues with the uninterrupted run's losses, bit for bit."""
    # A loader worker too: torchrun signals it as well, and it must outlive the signal save.
    args = TINY + [
        "distributed=fsdp2",
        "training.steps=30",
        "checkpoint.save_every_n_steps=5",
        "model.hidden_dropout=0.1",
        "data.num_workers=1",
    ]
    ref = _start(args, tmp_path / "ref", "run")
    ref_out = _finish(ref)
    assert ref.returncode == 0, ref_out[-3000:]
    expected = train_losses(tmp_path / "ref" / "run")
    assert sorted(expected) == list(range(1, 31))

    cwd = tmp_path / "job"
    ckpt = cwd / "outputs" / "vit_sanity" / run_name(args) / "checkpoints"
    proc = _start(args, cwd, "run1")
    _wait_for(lambda: len(train_losses(cwd / "run1")) >= 3, proc)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both workers
    out = _finish(proc)
    assert "stopping after step" in out, out[-3000:]
    stopped_at = max(train_losses(cwd / "run1"))
    assert stopped_at < 30 and (ckpt / f"step_{stopped_at}" / "COMPLETE").exists()

    proc = _start(args, cwd, "run2")  # killed -9 as soon as a later checkpoint is complete
    _wait_for(lambda: any(step_dirs(ckpt)) and complete_checkpoints(ckpt)[-1].name != f"step_{stopped_at}", proc)
    _kill9_all(proc)
    _finish(proc)
    assert max(train_losses(cwd / "run2")) < 30

    proc = _start(args, cwd, "run3")
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out
    segments = [train_losses(cwd / run) for run in ("run1", "run2", "run3")]
    assert max(segments[2]) == 30 and min(segments[2]) > stopped_at
    for segment in segments:
        for step, loss in segment.items():
            assert loss == expected[step], f"step {step}"


def _slow_marker(phases: list[dict], sentinel: str, slow_step: int) -> None:
    """Stall rank 0 between the DCP writes and the COMPLETE marker of step `slow_step`: after DCP's writer wrote
    its index (.metadata), which it does once every rank's data is on disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    finish = FileSystemWriter.finish

    def slow(self, metadata, results):
        finish(self, metadata, results)
        if str(self.path).endswith(f"step_{slow_step}"):
            Path(sentinel).write_text("writing the marker")
            time.sleep(600)

    FileSystemWriter.finish = slow
    run_phases(phases)


@pytest.mark.slow
def test_kill9_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    sentinel = tmp_path / "sentinel"
    first = [phase(tmp_path, "first", "ckpt", ["distributed=fsdp2", "checkpoint.save_every_n_steps=2"])]
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, 2, port, _slow_marker, (first, str(sentinel), 4), {}, dict(os.environ), os.getcwd()),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.time() + 300
    while not sentinel.exists():
        assert time.time() < deadline and all(p.is_alive() for p in procs), "the save at step 4 never started"
        time.sleep(0.05)
    for p in procs:
        p.kill()
        p.join()
    assert (ckpt / "step_4" / ".metadata").exists() and not (ckpt / "step_4" / "COMPLETE").exists()
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_2"]

    ref, resumed = run_workers(
        2,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", ["distributed=fsdp2"]),
            phase(tmp_path, "second", "ckpt", ["distributed=fsdp2", "checkpoint.save_every_n_steps=2"]),
        ],
    )[0]
    assert resumed["resumed_from"] == str(ckpt / "step_2")
    assert resumed["losses"] == {s: ref["losses"][s] for s in range(3, 9)}
    assert [p.name for p in step_dirs(ckpt)] == ["step_2", "step_4", "step_6", "step_8"]
    assert all(verify(p) for p in step_dirs(ckpt))  # step_4 was written again, completely
    # The interrupted save is gone once a later save completed: nothing set aside, nothing else kept.
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_2", "step_4", "step_6", "step_8"]


# ----------------------------------------------------------------------------- bad checkpoints, bad disks


@pytest.mark.slow
def test_corrupt_missing_and_incomplete_checkpoints(tmp_path):
    save = phase(tmp_path, "save", "ckpt", ["training.steps=4", "checkpoint.save_every_n_steps=2"])
    (first,) = run_workers(1, run_phases, [save])[0]
    ckpt = tmp_path / "ckpt"
    data_file = ckpt / "step_4" / "__0_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:1000])  # truncated
    incomplete = tmp_path / "incomplete" / "step_2"
    shutil.copytree(ckpt / "step_2", incomplete)
    (incomplete / "COMPLETE").unlink()  # as a save cut short leaves it: SAVING, no COMPLETE
    (incomplete / "SAVING").write_text("")
    results = run_workers(
        1,
        run_phases,
        [
            phase(
                tmp_path,
                "explicit",
                "ckpt",
                ["training.steps=4", f"checkpoint.resume={ckpt}/step_4"],
                expect_error=True,
            ),
            phase(
                tmp_path,
                "missing",
                "ckpt",
                ["training.steps=4", f"checkpoint.resume={tmp_path}/nowhere"],
                expect_error=True,
            ),
            phase(
                tmp_path,
                "incomplete",
                "ckpt",
                ["training.steps=4", f"checkpoint.resume={incomplete}"],
                expect_error=True,
            ),
            phase(tmp_path, "fresh", "ckpt", ["training.steps=4", "checkpoint.resume=false"], expect_error=True),
            phase(tmp_path, "auto", "ckpt", ["training.steps=4"]),
        ],
    )[0]
    explicit, missing, incomplete_result, fresh, auto = results
    assert (
        "CheckpointError" in explicit["error"]
        and "__0_0.distcp" in explicit["error"]
        and "truncated" in explicit["error"]
    )
    assert "no such checkpoint folder" in missing["error"]
    assert "incomplete checkpoint" in incomplete_result["error"]
    assert "checkpoint.overwrite=true" in fresh["error"]
    # Automatic resume warns and falls back to step 2; steps 3-4 come out as before.
    assert auto["resumed_from"] == str(ckpt / "step_2")
    assert auto["losses"] == {3: first["losses"][3], 4: first["losses"][4]}
    verify(ckpt / "step_4")  # saved again, whole

    (overwritten,) = run_workers(
        1,
        run_phases,
        [phase(tmp_path, "over", "ckpt", ["training.steps=1", "checkpoint.resume=false", "checkpoint.overwrite=true"])],
    )[0]
    assert overwritten["resumed_from"] is None and [p.name for p in step_dirs(ckpt)] == ["step_1"]


def _disk_full_at(phases: list[dict], failing_step: int) -> list[dict]:
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if str(self.path).endswith(f"step_{failing_step}"):
            raise OSError(28, "No space left on device")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing
    return run_phases(phases)


@pytest.mark.slow
def test_a_failing_save_fails_loudly_and_keeps_earlier_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    (result,) = run_workers(
        1,
        _disk_full_at,
        [phase(tmp_path, "run", "ckpt", ["training.steps=6", "checkpoint.save_every_n_steps=2"], expect_error=True)],
        4,
    )[0]
    assert "saving" in result["error"] and "step_4" in result["error"] and "No space left" in result["error"]
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_2"]
    verify(ckpt / "step_2")


class _NaNAtStep(Callback):
    """The model's output (so the loss) of every training micro-batch of optimizer step `bad_step` made NaN, by a
    forward hook on the run's model."""

    def __init__(self, bad_step: int):
        self.bad_step = bad_step

    def on_train_start(self, run) -> None:
        def poison(model, inputs, output):
            if model.training and run.state.step + 1 == self.bad_step:  # run.state.step: the steps completed
                return output * float("nan")
            return output

        run.parallel.model.register_forward_hook(poison)


def _nan_at_step(phases: list[dict], bad_step: int) -> list[dict]:
    return run_phases(phases, callbacks=(_NaNAtStep(bad_step),))


@pytest.mark.slow
def test_nonfinite_loss_stops_or_skips_and_is_never_saved(tmp_path):
    # 1 rank: 4 micro-batches per step; step 3 gets a NaN loss.
    common = ["training.steps=6", "checkpoint.save_every_n_steps=2", "training.log_every_n_steps=5"]
    stop, skip = run_workers(
        1,
        _nan_at_step,
        [
            phase(tmp_path, "stop", "ckpt_stop", common, expect_error=True),
            phase(tmp_path, "skip", "ckpt_skip", common + ["training.on_nonfinite=skip"], state=True),
        ],
        3,
    )[0]
    assert "NonFiniteError" in stop["error"] and "at step 3" in stop["error"]
    assert [p.name for p in step_dirs(tmp_path / "ckpt_stop")] == ["step_2"]  # step 4 was never saved
    assert skip["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in skip["state"].values())
    assert [p.name for p in complete_checkpoints(tmp_path / "ckpt_skip")] == ["step_2", "step_4", "step_6"]


# ----------------------------------------------------------------------------- retention and async saves


def test_retention_rule():
    entries = [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.6), (5, None), (6, 0.8)]
    assert checkpoints_to_keep(entries, 2, 0, 0, "min", set()) == {5, 6}
    assert checkpoints_to_keep(entries, 2, 2, 0, "min", set()) == {2, 4, 5, 6}
    assert checkpoints_to_keep(entries, 1, 0, 2, "min", set()) == {2, 4, 6}
    assert checkpoints_to_keep(entries, 1, 0, 1, "max", {1}) == {1, 6}  # 1 protected (resumed from), 1 also best
    assert checkpoints_to_keep(entries, -1, 0, 0, "min", set()) == {1, 2, 3, 4, 5, 6}
    assert checkpoints_to_keep([], 1, 0, 1, "min", set()) == set()


def test_set_aside_rule():
    from core.checkpointing.retention import set_aside_to_delete

    folders = [(3, True), (6, False), (6, True), (9, True), (9, False)]  # (step, complete)
    assert set_aside_to_delete(folders, 6, 2) == [0, 1, 2, 4]  # complete ones up to the newest step, all partial ones
    assert set_aside_to_delete(folders, 6, -1) == [1, 4]  # keep all: only interrupted saves go
    assert set_aside_to_delete(folders, 2, 1) == [1, 4]


def _fake_step(folder: Path, step: int, complete: bool, extra: tuple[str, ...] = ()) -> Path:
    """A step folder as a save of this tool leaves it: complete (COMPLETE listing .metadata), or interrupted."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    if complete:
        (folder / "COMPLETE").write_text(
            json.dumps(
                {
                    "step": step,
                    "metrics": {},
                    "files": {".metadata": {"size": 0, "crc32": 0}, "__0_0.distcp": {"size": 10, "crc32": 0}},
                }
            )
        )
    else:
        (folder / "SAVING").write_text("a save in progress\n")
    for name in extra:
        (folder / name).write_text("the user's\n")
    return folder


@pytest.mark.parametrize("keep_last_n", [2, -1])
def test_retention_deletes_set_aside_folders_of_this_tool_only(tmp_path, keep_last_n):
    """After a save completes, retention deletes this tool's interrupted saves that a resume set aside
    (step_<N>.superseded, as earlier versions named them), and, unless every checkpoint is kept, the complete
    set-aside ones the run's checkpoints have reached; never a folder that is not the tool's own, nor a link."""
    from core.checkpointing.manager import Checkpointer
    from core.config.schema import CheckpointConfig

    root = tmp_path / "ckpt"
    for step in (2, 4):
        _fake_step(root / f"step_{step}", step, complete=True)
    _fake_step(root / "step_6.superseded", 6, complete=False)  # an interrupted save set aside
    _fake_step(root / "step_3.superseded-2", 3, complete=False)
    _fake_step(root / "step_3.superseded", 3, complete=True)  # a branch the run went back from, caught up with
    _fake_step(root / "step_6.superseded-2", 6, complete=True)  # ... not yet caught up with
    _fake_step(root / "step_1.superseded", 1, complete=False, extra=("notes.txt",))  # holds a file of the user's
    _fake_step(root / "step_2.superseded", 7, complete=True)  # its marker names another step: not this tool's
    _fake_step(root / "elsewhere" / "step_5", 5, complete=False)
    (root / "step_5.superseded").symlink_to(root / "elsewhere" / "step_5")
    _fake_step(root / "mine.superseded", 1, complete=False)
    Checkpointer(CheckpointConfig(path=str(root), keep_last_n=keep_last_n), 0, torch.device("cpu"))._apply_retention()
    kept = {
        "step_2",
        "step_4",
        "step_6.superseded-2",
        "step_1.superseded",
        "step_2.superseded",
        "step_5.superseded",
        "mine.superseded",
        "elsewhere",
    } | ({"step_3.superseded"} if keep_last_n < 0 else set())
    assert {p.name for p in root.iterdir()} == kept
    assert (root / "elsewhere" / "step_5" / "SAVING").exists()


@pytest.mark.slow
def test_retention_keeps_exactly_the_right_folders_and_async_equals_sync(tmp_path):
    keep = [
        "training.steps=6",
        "checkpoint.save_every_n_steps=1",
        "training.val_every_n_steps=1",
        "checkpoint.keep_last_n=2",
        "checkpoint.keep_every_n_steps=3",
        "checkpoint.monitor=val/loss",
        "checkpoint.keep_best_k=1",
    ]
    both = ["training.steps=4", "checkpoint.save_every_n_steps=2"]
    run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "keep", "ckpt_keep", keep),
            phase(tmp_path, "sync", "ckpt_sync", both),
            phase(tmp_path, "async", "ckpt_async", both + ["checkpoint.async_save=true"]),
        ],
    )
    rows = read_records(tmp_path / "keep")
    val = {r["step"]: r["loss"] for r in rows if r.get("split") == "val"}
    best = min(val, key=val.get)
    assert {p.name for p in step_dirs(tmp_path / "ckpt_keep")} == {f"step_{s}" for s in {5, 6, 3, best}}

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (2, 4):
        contents = []
        for name in ("sync", "async"):
            verify(tmp_path / f"ckpt_{name}" / f"step_{step}")
            dcp_to_torch_save(tmp_path / f"ckpt_{name}" / f"step_{step}", tmp_path / f"{name}{step}.pt")
            contents.append(torch.load(tmp_path / f"{name}{step}.pt"))
        _assert_equal(*contents)


@pytest.mark.slow
def test_async_saves_of_megatron_fsdp_equal_sync_ones(tmp_path):
    """Megatron-FSDP (ZeRO-3, 2 ranks, CPU shim) state is copied shard by shard for the background
    writer; the checkpoints are identical to synchronous ones."""
    both = ["distributed=mfsdp", "training.steps=4", "checkpoint.save_every_n_steps=2"]
    run_workers(
        2,
        run_phases,
        [
            phase(tmp_path, "sync", "ckpt_sync", both),
            phase(tmp_path, "async", "ckpt_async", both + ["checkpoint.async_save=true"]),
        ],
        True,
    )
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (2, 4):
        contents = []
        for name in ("sync", "async"):
            dcp_to_torch_save(tmp_path / f"ckpt_{name}" / f"step_{step}", tmp_path / f"{name}{step}.pt")
            contents.append(torch.load(tmp_path / f"{name}{step}.pt"))
        _assert_equal(*contents)


# One AdamW step at this learning rate moves a weight by about 1e-30: below the last bit of any nonzero
# weight, so loaded weights stay as they are (a zero one becomes ~1e-30). 0 is not a valid learning rate.
TINY_LR = 1e-30
TINY_LR_ATOL = 1e-25


def _assert_equal(a, b, path: str = "", atol: float = 0.0) -> None:
    if isinstance(a, np.ndarray):
        assert np.allclose(a, b, rtol=0, atol=atol) if atol else np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}", atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}[{i}]", atol)
    elif torch.is_tensor(a):
        assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=atol, equal_nan=True), path
    else:
        assert a == b, path


# ----------------------------------------------------------------------------- weights in and out


def _export(step_dir: str, out_dir: str) -> None:
    from core.checkpointing.conversion import from_torch, to_safetensors, to_torch

    to_torch(step_dir, f"{out_dir}/weights.pt")
    to_safetensors(step_dir, f"{out_dir}/weights.safetensors")
    from_torch(f"{out_dir}/weights.pt", f"{out_dir}/converted/step_0")


def _unsharded_vit():
    from core.layers.namespace import get_layers
    from recipes.vit.recipe import ViTRecipe
    from tests.support.helpers import validated_config

    cfg = validated_config("vit_sanity", TINY + ["checkpoint.path=unused"])
    return ViTRecipe(cfg).build_model(get_layers("torch"), torch.device("cpu"))


@pytest.mark.slow
def test_conversion_round_trips(tmp_path):
    """DCP -> .pt / .safetensors / format_utils dcp_to_torch load strictly into the unsharded model with
    identical outputs; .pt -> DCP -> resume starts from exactly those weights."""
    from safetensors.torch import load_file

    (trained,) = run_workers(2, run_phases, [phase(tmp_path, "train", "ckpt", ["training.steps=2"], state=True)])[0]
    step_dir = tmp_path / "ckpt" / "step_2"
    subprocess.run(
        [sys.executable, str(REPO / "checkpoint.py"), "to-torch", str(step_dir), str(tmp_path / "cli.pt")],
        check=True,
        capture_output=True,
    )
    format_utils.dcp_to_torch_save(step_dir, tmp_path / "format_utils.pt")  # what its command line calls
    _export(str(step_dir), str(tmp_path))

    reference = _unsharded_vit()
    reference.load_state_dict(trained["state"], strict=True)
    images = torch.randn(3, 3, 28, 28)
    expected = reference(images)
    for weights in (
        torch.load(tmp_path / "cli.pt"),
        torch.load(tmp_path / "weights.pt"),
        load_file(str(tmp_path / "weights.safetensors")),
        torch.load(tmp_path / "format_utils.pt")["model"],
    ):
        model = _unsharded_vit()
        model.load_state_dict(weights, strict=True)
        assert torch.equal(model(images), expected)

    # Resuming from the converted folder: weights only, so a fresh optimizer at step 0; TINY_LR keeps them.
    (resumed,) = run_workers(
        2, run_phases, [phase(tmp_path, "resume", "converted", ["training.steps=1", f"optim.lr={TINY_LR}"], state=True)]
    )[0]
    assert resumed["resumed_from"] == str(tmp_path / "converted" / "step_0") and resumed["start_step"] == 0
    _assert_equal(resumed["state"], trained["state"], atol=TINY_LR_ATOL)


@pytest.mark.slow
def test_init_from_loads_weights_only_and_skips_prefixes(tmp_path):
    (source,) = run_workers(1, run_phases, [phase(tmp_path, "src", "ckpt", ["training.steps=2"], state=True)])[0]
    step_dir = tmp_path / "ckpt" / "step_2"
    torch.save(source["state"], tmp_path / "src.pt")
    # torch's own way back from a torch file (format_utils torch_to_dcp): a DCP folder without our marker,
    # of a flat {name: tensor} file and of dcp_to_torch's whole-checkpoint file (weights under "model").
    format_utils.torch_save_to_dcp(tmp_path / "src.pt", tmp_path / "dcp_flat")
    format_utils.dcp_to_torch_save(step_dir, tmp_path / "all.pt")
    format_utils.torch_save_to_dcp(tmp_path / "all.pt", tmp_path / "dcp_nested")
    lr0 = ["training.steps=1", f"optim.lr={TINY_LR}"]  # the loaded weights stay as they are
    fresh, from_dir, from_file, from_flat, from_nested, wrong = run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "fresh", "ckpt_fresh", lr0, state=True),
            phase(
                tmp_path,
                "dir",
                "ckpt_dir",
                lr0 + [f"checkpoint.init_from={step_dir}", "checkpoint.init_skip_prefixes=[head]"],
                state=True,
            ),
            phase(tmp_path, "file", "ckpt_file", lr0 + [f"checkpoint.init_from={tmp_path}/src.pt"], state=True),
            phase(tmp_path, "flat", "ckpt_flat", lr0 + [f"checkpoint.init_from={tmp_path}/dcp_flat"], state=True),
            phase(tmp_path, "nested", "ckpt_nested", lr0 + [f"checkpoint.init_from={tmp_path}/dcp_nested"], state=True),
            phase(
                tmp_path,
                "wrong",
                "ckpt_wrong",
                lr0 + [f"checkpoint.init_from={step_dir}", "model.num_classes=5"],
                expect_error=True,
            ),
        ],
    )[0]
    assert from_dir["start_step"] == 0 and from_dir["resumed_from"] is None
    for name, value in from_dir["state"].items():
        origin = fresh if name.startswith("head.") else source  # the head keeps its fresh init
        _assert_equal(value, origin["state"][name], name, TINY_LR_ATOL)
    for loaded in (from_file, from_flat, from_nested):
        _assert_equal(loaded["state"], source["state"], atol=TINY_LR_ATOL)
    assert "does not fit the model" in wrong["error"] and "head.weight: (10, 32) vs model (5, 32)" in wrong["error"]


@pytest.mark.slow
def test_retention_by_training_loss_and_a_checkpoint_root_for_init_from_and_resume(tmp_path):
    """checkpoint.monitor=train/loss keeps the checkpoint of the lowest training loss; a checkpoint root, or
    <root>/last, names its newest complete step folder wherever a checkpoint is taken (init_from, resume,
    checkpoint.py); a root without one is a clear error."""
    keep = [
        "training.steps=6",
        "checkpoint.save_every_n_steps=1",
        "checkpoint.keep_last_n=1",
        "checkpoint.monitor=train/loss",
        "checkpoint.monitor_mode=min",
        "checkpoint.keep_best_k=1",
    ]
    ((trained, last, root, resumed, empty, unknown),) = run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "keep", "ckpt", keep, state=True),
            phase(
                tmp_path,
                "last",
                "ckpt_last",
                ["training.steps=1", f"optim.lr={TINY_LR}", f"checkpoint.init_from={tmp_path}/ckpt/last"],
                state=True,
            ),
            phase(
                tmp_path,
                "root",
                "ckpt_root",
                ["training.steps=1", f"optim.lr={TINY_LR}", f"checkpoint.init_from={tmp_path}/ckpt"],
                state=True,
            ),
            phase(
                tmp_path, "resumed", "ckpt_other", ["training.steps=8", f"checkpoint.resume={tmp_path}/ckpt"] + keep[1:]
            ),
            phase(
                tmp_path,
                "empty",
                "ckpt_empty",
                ["training.steps=1", f"checkpoint.init_from={tmp_path}/ckpt_none/last"],
                expect_error=True,
            ),
            phase(
                tmp_path,
                "unknown",
                "ckpt_unknown",
                keep[:-1] + ["checkpoint.monitor=train/loss_typo"],
                expect_error=True,
            ),
        ],
    )
    losses = trained["losses"]
    best = min(losses, key=losses.get)
    kept = {p.name for p in step_dirs(tmp_path / "ckpt")}
    assert kept == {f"step_{best}", "step_6"}
    marker = json.loads((tmp_path / "ckpt" / "step_6" / "COMPLETE").read_text())
    assert marker["metrics"]["train/loss"] == losses[6] and "train/grad_norm" in marker["metrics"]
    for loaded in (last, root):  # weights of step_6, the newest
        _assert_equal(loaded["state"], trained["state"], atol=TINY_LR_ATOL)
    assert resumed["resumed_from"] == str(tmp_path / "ckpt" / "step_6") and resumed["start_step"] == 6
    assert "no complete checkpoint under" in empty["error"]
    assert (
        "checkpoint.monitor='train/loss_typo' is not a metric of this run; there are: train/grad_norm, "
        "train/loss, train/lr" in unknown["error"]
    )
    with_root = run_python(REPO / "checkpoint.py", "to-torch", tmp_path / "ckpt" / "last", tmp_path / "last.pt")
    assert with_root.returncode == 0, with_root.stderr
    assert torch.equal(torch.load(tmp_path / "last.pt")["head.weight"], trained["state"]["head.weight"])
