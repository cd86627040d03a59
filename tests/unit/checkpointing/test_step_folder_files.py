"""A step folder's own files read back as what they claim to be: COMPLETE of any other shape is a CheckpointError
naming it (automatic resume then falls back, retention leaves the folder alone), the index is checked against
COMPLETE before it is parsed, and the index cannot point outside the folder or claim more bytes than it has."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

import checkpoint
import core.checkpointing.layout as layout
import core.checkpointing.manager as manager
from core.checkpointing.dcp_index import index_from_json, load_index
from core.checkpointing.layout import CheckpointError, is_own, start_marker, verify, verify_plain_dcp, write_marker
from core.checkpointing.storage import ChecksummingWriter
from core.config.errors import ConfigError
from core.config.schema import CheckpointConfig
from tests.support.checkpoint_harness import TINY
from tests.support.helpers import read_records, train_run, validated_config


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "step_4"
    start_marker(folder)
    dcp.save(
        {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "train_state": {"step": 4}},
        storage_writer=ChecksummingWriter(str(folder)),
        no_dist=True,
    )
    write_marker(folder, {"step": 4, "metrics": {"val/loss": 1.5}})
    return folder


def _copy(step_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "step_4"
    shutil.copytree(step_dir, target)
    return target


def _marker(step_dir: Path) -> dict:
    return json.loads((step_dir / "COMPLETE").read_text())


MALFORMED = {
    "a list": lambda m: [1, 2, 3],
    "a number": lambda m: 7,
    "files a string": lambda m: {**m, "files": "abc"},
    "a files entry a string": lambda m: {**m, "files": {**m["files"], ".metadata": "abc"}},
    "no .metadata entry": lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != ".metadata"}},
    "a file outside the folder": lambda m: {**m, "files": {**m["files"], "../elsewhere": {"size": 1, "crc32": 0}}},
    "a CRC beyond 32 bits": lambda m: {**m, "files": {k: {**v, "crc32": 2**40} for k, v in m["files"].items()}},
    "a negative size": lambda m: {**m, "files": {k: {**v, "size": -1} for k, v in m["files"].items()}},
    "step a string": lambda m: {**m, "step": "4"},
    "metrics a list": lambda m: {**m, "metrics": [1]},
    "a metric a string": lambda m: {**m, "metrics": {"val/loss": "low"}},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_marker_is_a_checkpoint_error_naming_it(step_dir, tmp_path, case):
    folder = _copy(step_dir, tmp_path)
    (folder / "COMPLETE").write_text(json.dumps(MALFORMED[case](_marker(step_dir))))
    with pytest.raises(CheckpointError, match=str(folder / "COMPLETE")):
        verify(folder)
    assert not is_own(folder)  # never deleted as a checkpoint of this tool


def test_a_marker_that_is_not_utf8_or_json_is_a_checkpoint_error(step_dir, tmp_path):
    folder = _copy(step_dir, tmp_path)
    for content in (b"\xff\xfe{", b'{"step": 4,'):
        (folder / "COMPLETE").write_bytes(content)
        with pytest.raises(CheckpointError, match="unreadable completion marker"):
            verify(folder)


@pytest.mark.parametrize("parent", ["fills the index in place", "fills a copy"])
def test_index_json_holds_what_the_pickled_index_holds(tmp_path, monkeypatch, parent):
    """PyTorch versions differ in whether the writer's finish completes the index it is given or a copy of it
    (version, where each item lies); index.json must hold what .metadata holds either way."""
    if parent == "fills a copy":
        finish = FileSystemWriter.finish
        monkeypatch.setattr(
            FileSystemWriter,
            "finish",
            lambda self, metadata, results: finish(self, dataclasses.replace(metadata), results),
        )
    folder = tmp_path / "step_1"
    dcp.save(
        {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, "train_state": {"step": 1}},
        storage_writer=ChecksummingWriter(str(folder)),
        no_dist=True,
    )
    pickled = load_index((folder / ".metadata").read_bytes())
    from_json = index_from_json((folder / "index.json").read_bytes())
    assert from_json.version == pickled.version is not None
    assert from_json.state_dict_metadata == pickled.state_dict_metadata
    assert from_json.storage_data == pickled.storage_data and len(pickled.storage_data) == 3
    assert from_json.planner_data == pickled.planner_data


@pytest.mark.parametrize("index", ["index.json", ".metadata"])
def test_the_index_is_compared_with_the_marker_before_it_is_parsed(step_dir, tmp_path, monkeypatch, index):
    """index.json where the save wrote one; .metadata in a folder without it (written before it existed)."""
    folder = _copy(step_dir, tmp_path)
    if index == ".metadata":
        listed = _marker(step_dir)
        (folder / "index.json").unlink()
        del listed["files"]["index.json"]
        (folder / "COMPLETE").write_text(json.dumps(listed))
    data = (folder / index).read_bytes()
    assert data.count(b"1.0.0") == 1
    (folder / index).write_bytes(data.replace(b"1.0.0", b"2.0.0"))  # same length: only the CRC tells
    parsed = []
    for reader in ("load_index", "index_from_json"):
        monkeypatch.setattr(layout, reader, lambda data: parsed.append(data))
    with pytest.raises(CheckpointError, match=f"{index}: checksum mismatch"):
        verify(folder)
    assert not parsed


def test_an_index_json_of_another_shape_is_refused(step_dir, tmp_path):
    from core.checkpointing.dcp_index import UnsafeCheckpoint, index_from_json

    good = json.loads((step_dir / "index.json").read_text())
    assert (
        index_from_json(json.dumps(good).encode()).state_dict_metadata.keys()
        == load_index((step_dir / ".metadata").read_bytes()).state_dict_metadata.keys()
    )
    tensor = next(k for k, v in good["entries"].items() if v["kind"] == "tensor")
    bad = {
        "a list": [],
        "another format": {**good, "format": 2},
        "an unknown field": {**good, "more": 1},
        "a quantized dtype": {
            **good,
            "entries": {**good["entries"], tensor: {**good["entries"][tensor], "dtype": "torch.qint8"}},
        },
        "a size beyond any tensor": {
            **good,
            "entries": {**good["entries"], tensor: {**good["entries"][tensor], "size": [2**62, 2**62, 0]}},
        },
        "more dimensions than a tensor can have": {
            **good,
            "entries": {
                **good["entries"],
                tensor: {
                    **good["entries"][tensor],
                    "size": [1] * 65,
                    "chunks": [{"offsets": [0] * 65, "sizes": [1] * 65}],
                },
            },
        },
        # Each dimension in range and no element at all, but the sizes' product overflows an allocation.
        "sizes that overflow behind a 0": {
            **good,
            "entries": {**good["entries"], tensor: {**good["entries"][tensor], "size": [2**49, 2**49, 0]}},
        },
        "a file outside the folder": {**good, "storage": [{**s, "file": "../x"} for s in good["storage"]]},
        "a negative offset": {**good, "storage": [{**s, "at": -1} for s in good["storage"]]},
        "a string for a size": {
            **good,
            "entries": {**good["entries"], tensor: {**good["entries"][tensor], "size": ["2", "3"]}},
        },
    }
    for name, value in bad.items():
        with pytest.raises(UnsafeCheckpoint):
            index_from_json(json.dumps(value).encode())
        folder = _copy(step_dir, tmp_path / name.replace(" ", "_"))
        (folder / "index.json").write_text(json.dumps(value))
        (folder / "COMPLETE").unlink()
        write_marker(folder, {"step": 4, "metrics": {}})
        with pytest.raises(CheckpointError, match="index.json"):
            verify(folder)


def _with_storage(step_dir: Path, tmp_path: Path, change) -> Path:
    """A folder whose index has each storage entry changed by `change`, COMPLETE made to match."""
    folder = _copy(step_dir, tmp_path)
    index = load_index((folder / ".metadata").read_bytes())
    index.storage_data = {k: change(v) for k, v in index.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    (folder / "COMPLETE").unlink()
    (folder / "index.json").unlink(missing_ok=True)  # the pickle index is read
    write_marker(folder, {"step": 4, "metrics": {}})
    return folder


def test_the_index_cannot_point_outside_the_folder(step_dir, tmp_path):
    (tmp_path / "secret").write_bytes(b"x" * 4096)
    folder = _with_storage(step_dir, tmp_path, lambda s: _StorageInfo("../secret", s.offset, s.length))
    with pytest.raises(CheckpointError, match="not a file of the folder"):
        verify(folder)
    (folder / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="not a file of the folder"):
        verify_plain_dcp(folder)


def test_the_index_cannot_point_into_unlisted_files_or_claim_more_bytes_than_stored(step_dir, tmp_path):
    folder = _with_storage(step_dir, tmp_path / "a", lambda s: _StorageInfo("extra.distcp", s.offset, s.length))
    shutil.copy(next(folder.glob("*.distcp")), folder / "extra.distcp")
    with pytest.raises(CheckpointError, match="does not list"):
        verify(folder)
    folder = _with_storage(step_dir, tmp_path / "b", lambda s: _StorageInfo(s.relative_path, s.offset, 1))
    with pytest.raises(CheckpointError, match="claims more bytes than its storage holds"):
        verify(folder)


def _resave_with(step: Path, target: Path, change: dict) -> None:
    """A complete step folder like `step` (read in full, as our own trusted test data) with `change` applied to its
    flat keys (a value may be a function of the saved one); its marker made to match."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(step))
    config = (step / "config.yaml").read_bytes()
    for key, value in change.items():
        top, rest = key.split(".", 1)
        state[top][rest] = value(state[top][rest]) if callable(value) else value
    shutil.rmtree(target, ignore_errors=True)
    start_marker(target)
    dcp.save(state, storage_writer=ChecksummingWriter(str(target)), no_dist=True)
    (target / "config.yaml").write_bytes(config)
    write_marker(target, {"step": int(target.name.split("_")[1]), "metrics": {}})


def test_automatic_resume_falls_back_from_malformed_files_and_keeps_the_folders(tmp_path, caplog):
    def run(name: str, steps: int) -> dict:
        cfg = validated_config(
            "vit_sanity",
            TINY + [f"checkpoint.path={tmp_path}/ckpt", f"training.steps={steps}", "checkpoint.save_every_n_steps=2"],
        )
        return train_run(cfg, tmp_path / name)["result"]

    run("first", 6)
    ckpt = tmp_path / "ckpt"
    _resave_with(ckpt / "step_4", ckpt / "step_6", {"train_state.step": -5})  # valid files, a value that is not
    (ckpt / "step_4" / "COMPLETE").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match=f"this run saves step 4, but {ckpt / 'step_4'} exists and is not"):
        run("blocked", 5)  # before any step, not when it gets there
    assert not (tmp_path / "blocked" / "metrics.jsonl").exists()
    with caplog.at_level("WARNING"):
        result = run("again", 3)
    assert result.resumed_from == str(ckpt / "step_2")
    assert f"{ckpt / 'step_4' / 'COMPLETE'}: not a completion marker" in caplog.text
    assert "its train_state state cannot be taken (ValueError: train_state.step=-5" in caplog.text
    assert (ckpt / "step_4" / "COMPLETE").read_text() == "[1, 2, 3]" and list((ckpt / "step_4").glob("*.distcp"))


@pytest.mark.parametrize("value", [-5, "3", 3.0, True, float("nan"), 2**70])
def test_training_counters_from_a_file_are_whole_numbers(value):
    from core.training.state import TrainState

    with pytest.raises(ValueError, match=r"train_state\.consumed_samples="):
        TrainState().load_state_dict({"step": 3, "consumed_samples": value})


def test_fp8_state_restores_only_what_a_te_module_of_the_model_has(tmp_path):
    from core.checkpointing.fp8 import _settings
    from core.checkpointing.parts import FP8Part, Saved

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].fp8_meta = {"num_gemms": 1, "fp8_checkpoint": True, "recipe": object()}

    class Held(Saved):
        def __init__(self, keys):
            self.path, self.keys = tmp_path, keys

        def empty(self, key):
            return torch.zeros(1)

    part = FP8Part(model, fp8_recipe=object())
    assert set(part.load_target(Held(["0.scale_fwd", "0.settings"]))["0"]) == {"scale_fwd", "settings"}
    for keys in (["0.recipe"], ["1.scale_fwd"], ["scale_fwd"]):
        with pytest.raises(CheckpointError, match="not FP8 state"):
            part.load_target(Held(keys))
    blob = torch.frombuffer(
        bytearray(json.dumps({"num_gemms": 3, "fp8_checkpoint": "yes", "unknown": 1, "recipe": "x"}).encode()),
        dtype=torch.uint8,
    )
    assert _settings(blob, model[0].fp8_meta) == {"num_gemms": 3, "unknown": 1}
    with pytest.raises(ValueError, match="expected an object"):
        _settings(torch.frombuffer(bytearray(b"[1]"), dtype=torch.uint8), model[0].fp8_meta)


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run_dir) if "loss" in r}


def test_a_resume_takes_the_schedule_and_optimizer_switches_from_the_config_and_keeps_what_it_saves_over(
    tmp_path, caplog
):
    """A checkpoint whose schedule position (last_epoch -1000: a negative learning rate) and AdamW switch (maximize:
    gradient ascent) were rewritten resumes exactly like the untouched one; a benign edit to the newest step's
    config.yaml makes automatic resume fall back, and the folder skipped is kept beside, never saved over."""

    def run(name: str, root: str, steps: int) -> dict[int, dict]:
        cfg = validated_config(
            "vit_sanity",
            TINY
            + [
                f"checkpoint.path={tmp_path}/{root}",
                f"training.steps={steps}",
                "checkpoint.save_every_n_steps=2",
                "checkpoint.keep_last_n=-1",
            ],
        )
        train_run(cfg, tmp_path / name)
        return _records(tmp_path / name)

    run("first", "ckpt", 6)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "clean")
    step_6 = tmp_path / "ckpt" / "step_6"
    _resave_with(
        step_6,
        step_6,
        {
            "scheduler.last_epoch": -1000,
            "optim.param_groups": lambda groups: [{**g, "maximize": True, "amsgrad": False} for g in groups],
        },
    )
    crafted = run("crafted", "ckpt", 8)
    with (tmp_path / "clean" / "step_6" / "config.yaml").open("a") as f:
        f.write("# a note\n")
    with caplog.at_level("WARNING"):
        clean = run("clean", "clean", 8)  # falls back to step_4, trains 5..8, saves step_6 again
    assert "config.yaml: checksum mismatch" in caplog.text or "config.yaml:" in caplog.text
    for step in (7, 8):
        assert (crafted[step]["loss"], crafted[step]["lr"]) == (clean[step]["loss"], clean[step]["lr"]), step
    assert crafted[7]["lr"] > 0
    kept = tmp_path / "clean" / "step_6.superseded"
    assert (kept / "config.yaml").read_text().endswith("# a note\n") and list(kept.glob("*.distcp"))


def test_a_scheduler_state_of_another_shape_is_refused():
    from core.checkpointing.parts import StatefulPart

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    part = StatefulPart(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    own = part.state_dict()
    for change in (
        {"last_epoch": "abc"},
        {"base_lrs": [0.1, 0.2]},
        {"lr_lambdas": [{"__code__": 1}]},
        {"_last_lr": "x"},
    ):
        with pytest.raises(ValueError, match="LambdaLR"):
            part.load_state_dict({**own, **change})
    part.load_state_dict({**own, "last_epoch": 3, "base_lrs": [1]})  # a whole number stands for a float


def test_retention_never_ranks_a_nan():
    from core.checkpointing.retention import checkpoints_to_keep

    assert checkpoints_to_keep([(2, 0.5), (4, float("nan")), (6, 0.3), (8, 0.9)], 1, 0, 1, "min", set()) == {6, 8}


def test_the_index_must_cover_each_tensor_and_live_in_the_folder(step_dir, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = _copy(step_dir, tmp_path / "a")
    index = load_index((folder / ".metadata").read_bytes())
    entry = index.state_dict_metadata["model.w"]
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 3]))]  # half of it
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    (folder / "COMPLETE").unlink()
    (folder / "index.json").unlink(missing_ok=True)  # the pickle index is read
    write_marker(folder, {"step": 4, "metrics": {}})
    with pytest.raises(CheckpointError, match="the chunks of model.w do not hold its 6 elements"):
        verify(folder)
    folder = _copy(step_dir, tmp_path / "b")
    shard = next(folder.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="a symbolic link"):
        verify(folder)


def test_an_index_without_its_fields_or_with_more_is_refused(step_dir, tmp_path):
    from core.checkpointing.dcp_index import UnsafeCheckpoint

    empty = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81."  # NEWOBJ, no state
    with pytest.raises(UnsafeCheckpoint, match="not DCP metadata"):
        load_index(empty)
    index = load_index((step_dir / ".metadata").read_bytes())
    index.extra = [0] * 10
    with pytest.raises(UnsafeCheckpoint, match="not DCP metadata"):
        load_index(pickle.dumps(index))


def test_a_marker_that_is_no_regular_file_or_nested_too_deep_is_a_checkpoint_error(step_dir, tmp_path):
    folder = _copy(step_dir, tmp_path)
    marker = folder / "COMPLETE"
    marker.write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="unreadable completion marker"):
        verify(folder)
    marker.unlink()
    outside = tmp_path / "COMPLETE_elsewhere"
    outside.write_text((step_dir / "COMPLETE").read_text())
    marker.symlink_to(outside)  # a whole marker, but not the folder's own file
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify(folder)
    marker.unlink()
    os.mkfifo(marker)  # opened without waiting for a writer
    assert not is_own(folder)


def test_a_config_that_is_no_regular_file_is_a_checkpoint_error(step_dir, tmp_path):
    from core.checkpointing.saved_config import read_config_file

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="FIFO"):
        read_config_file(fifo)


def _forged(folder: Path, change) -> Path:
    """`folder` with its index.json rewritten by `change` and COMPLETE written again to match, as a forger would."""
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))
    step = json.loads((folder / "COMPLETE").read_text())["step"]
    (folder / "COMPLETE").unlink()
    write_marker(folder, {"step": step, "metrics": {}})
    return folder


def test_a_weight_stored_as_bytes_is_refused_on_every_reader(step_dir, tmp_path):
    """An index may declare any entry a value (bytes); a weight declared so is refused where weights are read:
    the fit check of resume and init_from, the export, and DCP's load planner, as a CheckpointError (so
    automatic resume falls back), never an AttributeError."""
    from torch.distributed.checkpoint.api import CheckpointException

    from core.checkpointing.layout import describe, empty_like_saved, saved_weights
    from core.checkpointing.storage import SafeLoadPlanner, SafeReader
    from core.checkpointing.weights import check_weights_fit, read_model_weights

    def as_bytes(index):
        index["entries"]["model.w"] = {"kind": "bytes"}
        for item in index["storage"]:
            if item["fqn"] == "model.w":
                item["offset"] = None

    folder = _forged(_copy(step_dir, tmp_path), as_bytes)
    metadata = verify(folder)  # the index itself has a valid shape
    with pytest.raises(CheckpointError, match=r"model\.w is stored as bytes, not as a tensor"):
        read_model_weights(folder)
    with pytest.raises(CheckpointError, match=r"model\.w is stored as bytes, where a tensor belongs"):
        empty_like_saved(metadata, "model.w")  # how the other parts (rng, fp8, optimizer) take their targets
    with pytest.raises(CheckpointError, match=r"w: not a tensor vs model \(2, 3\)"):
        check_weights_fit(str(folder), {"w": torch.zeros(2, 3)}, saved_weights(metadata))
    with pytest.raises(CheckpointException) as failed:
        dcp.load(
            {"model": {"w": torch.zeros(2, 3)}},
            storage_reader=SafeReader(str(folder), metadata),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert "'model.w' is stored as bytes, where a tensor belongs" in describe(failed.value)  # as the loaders report it


def test_the_chunks_must_hold_every_element_once_however_many_there_are(tmp_path):
    """294 tiles of one column each (more than any pairwise check would look at): laid out right they pass the
    coverage check; one tile moved onto its neighbours (the counts still add up) leaves elements unstored and
    is refused, naming index.json."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from core.checkpointing.layout import _overlap

    folder = tmp_path / "step_4"
    start_marker(folder)
    dcp.save({"model": {"w": torch.zeros(32, 147)}}, storage_writer=ChecksummingWriter(str(folder)), no_dist=True)
    write_marker(folder, {"step": 4, "metrics": {}})
    tiles = [{"offsets": [row, column], "sizes": [16, 1]} for row in (0, 16) for column in range(147)]
    entry = index_from_json((folder / "index.json").read_bytes()).state_dict_metadata["model.w"]
    tiled = dataclasses.replace(
        entry, chunks=[ChunkStorageMetadata(torch.Size(t["offsets"]), torch.Size(t["sizes"])) for t in tiles]
    )
    assert _overlap(tiled) is False
    moved = [*tiles[:-1], {"offsets": [8, 0], "sizes": [16, 1]}]  # rows 16-31 of the last column never stored

    def tile(index):
        index["entries"]["model.w"]["chunks"] = moved

    _forged(folder, tile)
    with pytest.raises(
        CheckpointError,
        match=rf"{folder / 'index.json'}: the chunks of model\.w do not hold its "
        r"4704 elements \(each once\)",
    ):
        verify(folder)
    outside = dataclasses.replace(
        entry,
        chunks=[
            ChunkStorageMetadata(torch.Size([17, 0]), torch.Size([16, 147])),
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([16, 147])),
        ],
    )
    assert _overlap(outside) is True
    diagonal = dataclasses.replace(
        entry,
        size=torch.Size([8192, 8192]),
        chunks=[ChunkStorageMetadata(torch.Size([i, i]), torch.Size([1, 1])) for i in range(8192)],
    )
    assert _overlap(diagonal) is None  # 2**26 cells: too many to check, refused by check_storage


def test_index_problems_name_the_file_the_index_was_read_from(step_dir, tmp_path):
    def no_storage(index):
        index["storage"] = [item for item in index["storage"] if item["fqn"] != "model.w"]

    folder = _forged(_copy(step_dir, tmp_path), no_storage)
    with pytest.raises(CheckpointError, match=rf"^{folder / 'index.json'}: model\.w has a chunk with no storage"):
        verify(folder)


def test_a_marker_of_another_step_than_its_folder_is_refused(step_dir, tmp_path):
    folder = _copy(step_dir, tmp_path)
    (folder / "COMPLETE").write_text(json.dumps({**_marker(step_dir), "step": 2}))
    with pytest.raises(
        CheckpointError, match=r"not a completion marker of this tool \(step 2, in the folder of step 4\)"
    ):
        verify(folder)
    assert not is_own(folder)  # never ranked, deleted or set aside as a checkpoint of this tool


def _aliased(shift: int):
    """A change to an index.json: three more weights whose storage is model.w's (`shift` bytes in: overlapping)."""

    def change(index: dict) -> None:
        stored = next(item for item in index["storage"] if item["fqn"] == "model.w")
        for i in (1, 2, 3):
            index["entries"][f"model.w{i}"] = index["entries"]["model.w"]
            index["storage"].append(
                {**stored, "fqn": f"model.w{i}", "at": stored["at"] + shift, "length": stored["length"] - shift}
            )

    return change


@pytest.mark.parametrize("shift", [0, 1])
def test_stored_items_that_share_bytes_are_refused_before_anything_is_allocated(step_dir, tmp_path, shift):
    """Each item is read into a tensor of its own: many index entries on one item would make a small folder cost
    many times its size. One line naming the index and two of the items, from every reader."""
    folder = _forged(_copy(step_dir, tmp_path), _aliased(shift))
    refusal = rf"^{re.escape(str(folder / 'index.json'))}: the storage of 'model\.w' and of 'model\.w1' share bytes of "
    with pytest.raises(CheckpointError, match=refusal):
        verify(folder)
    with pytest.raises(SystemExit) as stopped:
        checkpoint.main(["to-torch", str(folder), str(tmp_path / "w.pt")])
    assert stopped.value.code == 3 and re.match(refusal[1:], str(stopped.value)[len("error: ") :]), stopped.value
    assert not (tmp_path / "w.pt").exists()
    # The pickled index (DCP folders from elsewhere) is held to the same.
    index = load_index((step_dir / ".metadata").read_bytes())
    where, stored = next((k, v) for k, v in index.storage_data.items() if k.fqn == "model.w")
    index.storage_data[MetadataIndex("model.w1", where.offset)] = _StorageInfo(
        stored.relative_path, stored.offset + shift, stored.length - shift
    )
    with pytest.raises(layout.UnsafeCheckpoint, match="the storage of 'model.w' and of 'model.w1' share bytes"):
        load_index(pickle.dumps(index))


def test_rng_state_of_a_name_resume_does_not_take_is_not_read(tmp_path):
    """A resume reads a rank's RNG states that set_rng_state takes; any other key listed gets no tensor."""
    from core.checkpointing.parts import RNGPart, Saved
    from core.checkpointing.rng import rng_state

    cpu = torch.device("cpu")
    dcp.save({"rng": {"rank_0": {**rng_state(cpu), "junk": torch.zeros(1000)}}}, checkpoint_id=tmp_path, no_dist=True)
    saved = Saved(tmp_path, load_index((tmp_path / ".metadata").read_bytes()), "rng")
    assert "rank_0.junk" in saved.keys
    target = RNGPart(0, 1, cpu, is_main=True).load_target(saved)
    assert set(target["rank_0"]) == set(rng_state(cpu))


@pytest.mark.parametrize("failing", ["save_config", "write_marker"])
def test_a_save_whose_last_files_cannot_be_written_is_one_error_naming_the_folder(tmp_path, monkeypatch, failing):
    """The disk fills (or turns read-only) after the shards, while rank 0 writes config.yaml or COMPLETE: a
    CheckpointError naming the step folder (train.py's one `checkpoint error:` line, exit 3), not an OSError's
    traceback; without COMPLETE the folder stays an interrupted save, never resumed from."""
    folder = tmp_path / "step_2"
    start_marker(folder)
    dcp.save({"train_state": {"step": 2}}, storage_writer=ChecksummingWriter(str(folder)), no_dist=True)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager, failing, disk_full)
    checkpointer = manager.Checkpointer(
        CheckpointConfig(path=str(tmp_path)), 0, torch.device("cpu"), OmegaConf.create()
    )
    with pytest.raises(CheckpointError, match=rf"saving {re.escape(str(folder))} failed \(OSError: .*No space left"):
        checkpointer._finish(manager.PendingSave(None, folder, 2, {}, 0.0))
    assert not (folder / "COMPLETE").exists() and (folder / "SAVING").exists()
