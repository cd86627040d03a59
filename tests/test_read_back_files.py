"""Every file the program reads back is parsed against its expected shape: the checkpoint path's LOCK,
run.json, metrics.jsonl and a Hugging Face folder's config.json and shard index. A file of another shape
gives a message naming the file (and what happens next), never a traceback; and two starters racing for one
LOCK never both hold it."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint import main as checkpoint_cli
from core.checkpointing.lock import LockHeld, PathLock, read_lock
from core.config.run_record import read_run_record, recorded_run_dir, write_run_record
from core.config.schema import LoggerConfig
from core.metrics.history import SUPERSEDED, keep_history_up_to
from core.metrics.logger import MetricsLogger
from recipes.gpt.hf import import_from_hf, llama_config, llama_shapes, read_hf_weights

# Contents of a LOCK that is not a lock record: no holder can be named from them.
NOT_LOCK_RECORDS = {
    "empty": b"",
    "a JSON array": b"[1]",
    "pid text": b'{"pid": "abc"}',
    "not UTF-8": b'{"host": "n\xff", "pid": 1, "job": null, "since": 0}',
    "pid a bool": b'{"host": "n", "pid": true, "job": null, "since": 0}',
    "pid 0": b'{"host": "n", "pid": 0, "job": null, "since": 0}',
    "since NaN": b'{"host": "n", "pid": 1, "job": null, "since": NaN}',
    "not JSON": b"held by alice",
}

# ----------------------------------------------------------------------------- LOCK: two starters racing

TRIALS = 100  # each trial can catch a race; one in ten or more did with the lock of before


def _start_together(me: int, trial: int, ready, go) -> None:
    """Both starters spin until the other is spinning too, so they call acquire within microseconds of
    each other (a barrier alone wakes them too far apart to meet inside the creation of a lock)."""
    deadline = time.monotonic() + 30
    if me == 0:
        while ready.value != trial:
            if time.monotonic() > deadline:
                raise TimeoutError("the other starter never came")
        go.value = trial
    else:
        ready.value = trial
        while go.value != trial:
            if time.monotonic() > deadline:
                raise TimeoutError("the other starter never came")


def _contend(me: int, root: str, ready, go, both, results) -> None:
    """One starter: in each trial folder, try to take the lock the moment the other starter does; hold it
    until both have tried (so a refusal is not merely the winner having released it already)."""
    for trial in range(TRIALS):
        lock = PathLock(Path(root) / str(trial))
        both.wait(timeout=30)
        _start_together(me, trial, ready, go)
        try:
            lock.acquire()
            outcome = "won"
        except LockHeld:
            outcome = "refused"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            outcome = f"{type(e).__name__}: {e}"
        both.wait(timeout=30)  # both have tried
        holder = read_lock(lock.path)
        names_me = holder is not None and holder.holder is not None and holder.holder.pid == os.getpid()
        results.put((trial, outcome, names_me))
        both.wait(timeout=30)  # both have looked
        lock.release()


def _race(root: Path) -> dict[int, list[tuple[str, bool]]]:
    context = multiprocessing.get_context("fork")  # no re-import per starter: the race stays a few seconds
    ready, go = context.RawValue("i", -1), context.RawValue("i", -1)
    both, results = context.Barrier(2), context.Queue()
    starters = [context.Process(target=_contend, args=(me, str(root), ready, go, both, results), daemon=True)
                for me in (0, 1)]
    for p in starters:
        p.start()
    outcomes: dict[int, list[tuple[str, bool]]] = {}
    try:
        for _ in range(2 * TRIALS):
            trial, outcome, names_me = results.get(timeout=60)
            outcomes.setdefault(trial, []).append((outcome, names_me))
    finally:
        for p in starters:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in starters] == [0, 0]
    return outcomes


def _assert_one_holder_per_trial(outcomes: dict[int, list[tuple[str, bool]]]) -> None:
    for trial, pair in sorted(outcomes.items()):
        assert sorted(pair) == [("refused", False), ("won", True)], f"trial {trial}: {pair}"


def test_two_starters_racing_for_a_new_lock_never_both_hold_it(tmp_path):
    """The loser reads the winner's complete record (never a half-written LOCK it would judge stale)."""
    _assert_one_holder_per_trial(_race(tmp_path))


def test_two_starters_taking_over_one_stale_lock_never_both_hold_it(tmp_path):
    for trial in range(TRIALS):  # a lock of a run on another host, not refreshed for decades
        lock = tmp_path / str(trial) / "LOCK"
        lock.parent.mkdir()
        lock.write_text(json.dumps({"host": "gone-node", "pid": 1, "job": None, "since": 0}))
        os.utime(lock, (1, 1))
    _assert_one_holder_per_trial(_race(tmp_path))


def test_a_lock_created_while_another_starter_took_over_is_put_back(tmp_path):
    """A starter judged LOCK stale, but before it moved it away another run had replaced it with its own: the
    new lock stays, and the starter reports that it took nothing away."""
    lock = tmp_path / "LOCK"
    lock.write_text(json.dumps({"host": "gone-node", "pid": 1, "job": None, "since": 0}))
    os.utime(lock, (1, 1))
    late = PathLock(tmp_path)
    judged = read_lock(lock)
    assert late._stale_reason(judged) is not None
    lock.unlink()
    fresh = {"host": "other-node", "pid": 7, "job": None, "since": time.time()}
    lock.write_text(json.dumps(fresh))
    assert not late._take_away(judged)
    assert json.loads(lock.read_text()) == fresh and [p.name for p in tmp_path.iterdir()] == ["LOCK"]


# ----------------------------------------------------------------------------- LOCK: its shape


@pytest.mark.parametrize("content", NOT_LOCK_RECORDS.values(), ids=NOT_LOCK_RECORDS.keys())
def test_a_lock_that_is_not_a_lock_record_is_held_by_an_unknown_run_while_fresh(content, tmp_path):
    (tmp_path / "LOCK").write_bytes(content)
    with pytest.raises(LockHeld) as refused:
        PathLock(tmp_path, stale_after_s=300).acquire()
    assert f"{tmp_path / 'LOCK'} is not a lock record" in str(refused.value)
    assert f"If no run uses {tmp_path}, delete {tmp_path / 'LOCK'}" in str(refused.value)
    assert (tmp_path / "LOCK").read_bytes() == content


@pytest.mark.parametrize("content", NOT_LOCK_RECORDS.values(), ids=NOT_LOCK_RECORDS.keys())
def test_a_lock_that_is_not_a_lock_record_is_taken_over_once_old(content, tmp_path, caplog):
    (tmp_path / "LOCK").write_bytes(content)
    os.utime(tmp_path / "LOCK", (time.time() - 400,) * 2)
    lock = PathLock(tmp_path, stale_after_s=300)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        lock.acquire()
    try:
        warning, = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"taking over the lock {tmp_path / 'LOCK'}: it is not a lock record" in warning
        assert "has not been modified for 400 s" in warning
        assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / "LOCK").exists()


def test_without_hard_links_the_lock_is_created_in_place(tmp_path, monkeypatch):
    def no_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = PathLock(tmp_path)
    lock.acquire()
    try:
        assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
        with pytest.raises(LockHeld, match=f"pid {os.getpid()}"):
            PathLock(tmp_path).acquire()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]  # no private files left behind
    finally:
        lock.release()


def test_the_holder_warns_once_when_its_lock_names_another_run(tmp_path, caplog):
    lock = PathLock(tmp_path, refresh_s=0.02)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        lock.acquire()
        try:
            other = {"host": "other-node", "pid": 7, "job": None, "since": 0}
            (tmp_path / "LOCK").write_text(json.dumps(other))
            deadline = time.monotonic() + 10
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # ten more refreshes: no second warning
        finally:
            lock.release()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no longer names this run (now: host other-node, pid 7" in warnings[0]
    assert json.loads((tmp_path / "LOCK").read_text()) == other  # not refreshed, not removed: not this run's


# ----------------------------------------------------------------------------- run.json

NOT_RUN_RECORDS = {
    "a list": b'["outputs/run"]',
    "a number": b"3",
    "run_dir a number": b'{"run_dir": 3}',
    "run_dir missing": b'{"wandb_id": "abc"}',
    "wandb_id a number": b'{"run_dir": "outputs/run", "wandb_id": 5}',
    "not UTF-8": b'{"run_dir": "outputs/r\xffn"}',
    "torn": b'{"run_dir": "outp',
}


@pytest.mark.parametrize("content", NOT_RUN_RECORDS.values(), ids=NOT_RUN_RECORDS.keys())
def test_a_run_json_that_is_not_a_run_record_starts_a_new_record(content, tmp_path, caplog):
    (tmp_path / "run.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert recorded_run_dir(str(tmp_path), "outputs/new") == "outputs/new"
        assert not caplog.records  # the Hydra resolver stays silent: the logger warns, once, on rank 0
        assert read_run_record(tmp_path) == {}
    warning, = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{tmp_path / 'run.json'} is not a run record (")
    assert "this invocation starts a new run record" in warning


def test_a_run_record_reads_back_as_written(tmp_path):
    record = {"run_dir": "/runs/a", "wandb_id": "0123abcd", "added_later": [1, 2]}
    write_run_record(tmp_path, record)
    assert read_run_record(tmp_path) == record and recorded_run_dir(str(tmp_path), "x") == "/runs/a"
    write_run_record(tmp_path, {"run_dir": "/runs/b", "wandb_id": None})
    assert read_run_record(tmp_path) == {"run_dir": "/runs/b"}


def test_a_run_resumed_without_its_earlier_history_says_so(tmp_path, caplog):
    """run.json names the run directory, which was deleted: Hydra made it again, empty. On resuming, the
    console shows a warning naming run.json, the directory and the missing history; the run stays there."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    write_run_record(ckpt, {"run_dir": str(run_dir.resolve())})
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, LoggerConfig(stdout=False), True, {}, str(ckpt))
    with caplog.at_level(logging.INFO, logger="train"):
        logger.open(start_step=4, resumed=True)
    logger.close()
    warning, = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"resuming at step 4, but the metrics history of earlier invocations (steps up to 4) "
                              f"is not in {run_dir / 'metrics.jsonl'}")
    assert f"{ckpt / 'run.json'} names {run_dir.resolve()} as this run's directory" in warning
    assert read_run_record(ckpt)["run_dir"] == str(run_dir.resolve())  # later invocations stay together

    caplog.clear()  # with its history there, resuming is quiet
    (run_dir / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    logger = MetricsLogger(run_dir, LoggerConfig(stdout=False), True, {}, str(ckpt))
    with caplog.at_level(logging.INFO, logger="train"):
        logger.open(start_step=4, resumed=True)
    logger.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------- metrics.jsonl


def test_lines_that_are_not_records_move_aside_byte_for_byte(tmp_path):
    """One non-UTF-8 byte, a JSON array, a step that is text or a bool: moved aside unchanged, and the
    resume goes on (before, the first of these stopped every resume with UnicodeDecodeError)."""
    lines = [b'{"step": 1, "loss": 2.0}', b'{"step": 2, "note": "caf\xe9"}', b'{"step": 2, "loss": 1.5}',
             b"[1, 2]", b'{"step": "3", "loss": 1.2}', b'{"step": true}', b'{"step": 3, "loss": 1.1}',
             b'{"step": 4, "lo']
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b"\n".join(lines))  # the last line torn: no newline
    assert keep_history_up_to(metrics, 2) == 6
    assert metrics.read_bytes() == lines[0] + b"\n" + lines[2] + b"\n"
    assert (tmp_path / SUPERSEDED).read_bytes() == b"".join(line + b"\n" for line in lines[1:2] + lines[3:])
    assert keep_history_up_to(metrics, 2) == 0


# ----------------------------------------------------------------------------- Hugging Face folders

SETTINGS = {"hidden_size": 16, "num_layers": 1, "num_attention_heads": 2, "num_query_groups": 1,
            "ffn_hidden_size": 24, "seq_length": 8, "norm_epsilon": 1e-5, "tie_embeddings": False,
            "rotary_base": 10000.0, "init_std": 0.02, "vocab_size": 32}


@pytest.fixture
def llama(tmp_path) -> Path:
    """A tiny Llama folder, as `checkpoint.py to-hf` writes it (random weights)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=generator) for name, shape in llama_shapes(SETTINGS).items()},
              str(folder / "model.safetensors"))
    config = llama_config(SETTINGS, SETTINGS["vocab_size"], {}, "float32")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _from_hf_error(folder: Path, out: Path) -> str:
    with pytest.raises(SystemExit) as stopped:
        checkpoint_cli(["from-hf", str(folder), str(out)])
    assert not out.exists()
    return str(stopped.value)


def test_a_well_formed_llama_folder_imports(llama, tmp_path):
    assert "model.hidden_size=16" in import_from_hf(str(llama), str(tmp_path / "w.safetensors"))


@pytest.mark.parametrize("change,named", [
    ({"hidden_size": 16.0}, "hidden_size=16.0: Input should be a valid integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: Input should be greater than or equal to 1"),
    ({"vocab_size": -32}, "vocab_size=-32"),
    ({"intermediate_size": "24"}, "intermediate_size='24'"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True"),
    ({"num_key_value_heads": 1.5}, "num_key_value_heads=1.5"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings=1099511627776"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0: Input should be greater than 0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan: Input should be a finite number"),
    ({"rope_theta": float("inf")}, "rope_theta=inf"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_parameters.rope_theta='1e4'"),
    ({"rope_parameters": [1]}, "rope_parameters=[1]: Input should be a valid dictionary"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false': Input should be a valid boolean"),
    ({"initializer_range": -0.02}, "initializer_range=-0.02"),
    ({"hidden_act": 3}, "hidden_act=3"),
    ({"hidden_size": None}, "hidden_size missing"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_config_json_field_of_the_wrong_type_or_range_is_refused(change, named, llama, tmp_path):
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(config | change))
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'config.json'}: ") and named in error


@pytest.mark.parametrize("content,named", [
    (b"[1]", "Input should be an object"),
    (b'{"model_type": "ll\xffama"}', "Invalid JSON"),
    (b"", "Invalid JSON"),
], ids=["array", "not_utf8", "empty"])
def test_a_config_json_that_is_not_a_json_object_is_refused(content, named, llama, tmp_path):
    (llama / "config.json").write_bytes(content)
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'config.json'}: ") and named in error


def _shard(folder: Path) -> tuple[Path, dict[str, str]]:
    """The weights as one shard with an index, as save_pretrained writes large models."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = llama_shapes(SETTINGS)
    return folder / "model.safetensors.index.json", {name: "model-00001-of-00001.safetensors" for name in names}


def test_a_well_formed_shard_index_reads(llama):
    index, weight_map = _shard(llama)
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert set(read_hf_weights(llama)) == set(weight_map)


@pytest.mark.parametrize("changed,named", [
    ("{outside}", "weight_map='{outside}': Input should be a valid dictionary"),
    ({"model.norm.weight": "../outside.safetensors"}, "weight_map.model.norm.weight='../outside.safetensors': "
                                                      "should be the name of a file in the model folder"),
    ({"model.norm.weight": "{outside}"}, "weight_map.model.norm.weight='{outside}'"),
    ({"model.norm.weight": "llama/model-00001-of-00001.safetensors"}, "='llama/model-00001-of-00001.safetensors'"),
    ({"model.norm.weight": ".."}, "weight_map.model.norm.weight='..'"),
    ({"model.norm.weight": 1}, "weight_map.model.norm.weight=1: Input should be a valid string"),
    ({}, "weight_map={{}}: Dictionary should have at least 1 item"),
    ({"model.norm.weight": "model-00002-of-00002.safetensors"}, "names model-00002-of-00002.safetensors, not a file"),
], ids=["not_an_object", "parent", "absolute", "subfolder", "dotdot", "not_a_name", "empty", "absent_shard"])
def test_a_shard_index_naming_files_outside_the_folder_is_refused(changed, named, llama, tmp_path):
    """The shard names come from the file: one that reaches outside the folder (here: to a readable shard
    beside it) or names no file there is refused, naming the index and the tensor."""
    index, weight_map = _shard(llama)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((llama / "model-00001-of-00001.safetensors").read_bytes())
    if isinstance(changed, str):
        weight_map = changed.format(outside=outside)
    elif changed:
        weight_map |= {k: v.format(outside=outside) if isinstance(v, str) else v for k, v in changed.items()}
    else:
        weight_map = {}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError) as refused:
        read_hf_weights(llama)
    assert str(refused.value).startswith(f"{index}: ") and named.format(outside=outside) in str(refused.value)


def test_a_shard_index_that_is_not_utf8_json_is_refused(llama):
    index, _ = _shard(llama)
    index.write_bytes(b'{"weight_map": {"a": "b\xff"}}')
    with pytest.raises(ValueError, match=f"^{index}: Invalid JSON"):
        read_hf_weights(llama)


def test_a_damaged_safetensors_file_is_refused_by_name(llama, tmp_path):
    (llama / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'model.safetensors'}: cannot read as safetensors")
