"""Every file the program reads back is parsed against its expected shape: the checkpoint path's LOCK,
run.json, metrics.jsonl and a Hugging Face folder's config.json, shard index and pytorch_model.bin. A file of
another shape, or a name that is not a regular file at all (a FIFO, a directory, a link to /dev/zero), gives a
message naming the file (and what happens next), never a traceback, a hang or a flood of memory; and two
starters racing for one LOCK never both hold it, even from different PID namespaces."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint import main as checkpoint_cli
from core.checkpointing.hf_folders import read_hf_weights
from core.checkpointing.lock import LockHeld, PathLock, read_lock
from core.config.errors import ConfigError
from core.config.file_shape import NotThisKindOfFile, read_small_file
from core.config.run_record import read_run_record, recorded_run_dir, write_run_record
from core.config.schema import LoggerConfig
from core.metrics.history import SUPERSEDED, keep_history_up_to
from core.metrics.logger import MetricsLogger
from recipes.gpt.hf import import_from_hf, llama_config, llama_shapes
from tests.support.helpers import within
from tests.support.lock_race import TRIALS, race

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
    "nested too deeply": b"[" * 100_000 + b"]" * 100_000,
}


def _dead_pid() -> int:
    """The pid of a process that has ended (reaped: no process has it, until the kernel hands it out again)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# Names that are not a small regular file, each made at `path` (in a folder `tmp` with a readable file beside).
SPECIAL = {
    "a FIFO": lambda path, tmp: os.mkfifo(path),
    "a link to /dev/zero": lambda path, tmp: os.symlink("/dev/zero", path),
    "a link to a regular file": lambda path, tmp: os.symlink(tmp / "elsewhere", path),
    "a directory": lambda path, tmp: (path.mkdir(), (path / "kept").write_text("mine")),
}
SPECIAL_SAYS = {
    "a FIFO": "it is a FIFO, not a regular file",
    "a link to /dev/zero": "it is a symbolic link, not followed",
    "a link to a regular file": "it is a symbolic link, not followed",
    "a directory": "it is a directory, not a regular file",
}

# ----------------------------------------------------------------------------- reading a small file


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_name_that_is_not_a_small_regular_file_is_refused_without_blocking(kind, tmp_path):
    (tmp_path / "elsewhere").write_text("{}")
    SPECIAL[kind](tmp_path / "f", tmp_path)
    with within(5), pytest.raises(NotThisKindOfFile, match=SPECIAL_SAYS[kind]):
        read_small_file(tmp_path / "f", 100)


def test_a_small_file_is_read_whole_and_a_larger_one_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_small_file(tmp_path / "f", 100) == b"x" * 100
    with pytest.raises(NotThisKindOfFile, match="it is larger than 99 bytes"):
        read_small_file(tmp_path / "f", 99)
    os.symlink(tmp_path / "f", tmp_path / "link")
    assert read_small_file(tmp_path / "link", 100, follow_symlinks=True) == b"x" * 100
    with pytest.raises(FileNotFoundError):
        read_small_file(tmp_path / "absent", 100)


# ----------------------------------------------------------------------------- LOCK: two starters racing


def _assert_one_holder_per_trial(outcomes: dict[int, list[tuple[str, bool]]]) -> None:
    for trial, pair in sorted(outcomes.items()):
        assert sorted(pair) == [("refused", False), ("won", True)], f"trial {trial}: {pair}"


def test_two_starters_racing_for_a_new_lock_never_both_hold_it(tmp_path):
    """The loser reads the winner's complete record (never a half-written LOCK it would judge stale)."""
    _assert_one_holder_per_trial(race(tmp_path))


def test_two_starters_taking_over_one_stale_lock_never_both_hold_it(tmp_path):
    for trial in range(TRIALS):  # a lock of a run on another host, not refreshed for decades
        lock = tmp_path / str(trial) / "LOCK"
        lock.parent.mkdir()
        lock.write_text(json.dumps({"host": "gone-node", "pid": 1, "job": None, "since": 0}))
        os.utime(lock, (1, 1))
    _assert_one_holder_per_trial(race(tmp_path))


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
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"taking over the lock {tmp_path / 'LOCK'}: it is not a lock record" in warning
        assert "has not been modified for 400 s" in warning
        assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / "LOCK").exists()


@pytest.mark.parametrize("kind", ["a FIFO", "a link to /dev/zero", "a link to a regular file"])
def test_a_lock_that_is_not_a_regular_file_is_held_while_fresh_and_taken_over_once_old(kind, tmp_path, caplog):
    """Read without blocking or following it: held by an unknown run while fresh, and once old taken away
    (the link itself, never what it points to) and replaced by this run's lock."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(json.dumps({"host": "other-node", "pid": 7, "job": None, "since": time.time()}))
    root = tmp_path / "ckpt"
    root.mkdir()
    SPECIAL[kind](root / "LOCK", tmp_path)
    with within(5), pytest.raises(LockHeld) as refused:
        PathLock(root, stale_after_s=300).acquire()
    assert f"{root / 'LOCK'} is not a lock record ({SPECIAL_SAYS[kind]}" in str(refused.value)
    os.utime(root / "LOCK", (time.time() - 400,) * 2, follow_symlinks=False)
    lock = PathLock(root, stale_after_s=300)
    with within(5), caplog.at_level(logging.WARNING, logger="checkpoint"):
        lock.acquire()
    try:
        assert f"taking over the lock {root / 'LOCK'}: it is not a lock record" in caplog.text
        assert (root / "LOCK").is_file() and not (root / "LOCK").is_symlink()
        assert json.loads((root / "LOCK").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert json.loads(elsewhere.read_text())["pid"] == 7 and os.listdir(root) == []


def test_a_lock_that_is_a_directory_is_never_taken_over(tmp_path):
    """No run makes LOCK a directory, and taking it away would delete what it holds: however old, the
    message says to look inside and remove it."""
    SPECIAL["a directory"](tmp_path / "LOCK", tmp_path)
    os.utime(tmp_path / "LOCK", (1, 1))
    with pytest.raises(LockHeld) as refused:
        PathLock(tmp_path, stale_after_s=300).acquire()
    assert str(refused.value).startswith(f"{tmp_path / 'LOCK'} is a directory, not a lock file")
    assert f"rm -r {tmp_path / 'LOCK'}" in str(refused.value)
    assert (tmp_path / "LOCK" / "kept").read_text() == "mine" and os.listdir(tmp_path) == ["LOCK"]


def test_a_lock_far_larger_than_a_record_is_not_read_whole(tmp_path):
    (tmp_path / "LOCK").write_bytes(b" " * (1 << 20))
    with pytest.raises(LockHeld, match="is not a lock record \\(it is larger than 65536 bytes"):
        PathLock(tmp_path).acquire()


# ----------------------------------------------------------------------------- LOCK: PID namespaces


def _lock_of_this_host(root: Path, **fields) -> Path:
    """A fresh lock naming this host and a pid no process here has; `fields` change or remove (None) others."""
    me = PathLock(root).me
    record = {
        "host": me["host"],
        "pid": _dead_pid(),
        "job": None,
        "since": time.time(),
        "pidns": me["pidns"],
        "boot": me["boot"],
    } | fields
    lock = root / "LOCK"
    lock.write_text(json.dumps({k: v for k, v in record.items() if v is not ...}))
    return lock


def test_a_lock_records_where_its_pid_means_a_process(tmp_path):
    lock = PathLock(tmp_path)
    lock.acquire()
    try:
        record = json.loads((tmp_path / "LOCK").read_text())
    finally:
        lock.release()
    assert record["pidns"] == str(os.stat("/proc/self/ns/pid").st_ino)
    assert record["boot"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.mark.parametrize(
    "other",
    [{"pidns": "4026530000"}, {"boot": "another-boot"}, {"pidns": None}],
    ids=["pid namespace", "boot", "namespace unknown"],
)
def test_a_lock_from_another_pid_namespace_on_this_host_is_respected_while_fresh(other, tmp_path, caplog):
    """Two containers sharing the host name: the holder's pid means nothing here (no process has it here, yet
    the holder runs), so the lock is judged like one from another host: held while refreshed."""
    lock = _lock_of_this_host(tmp_path, **other)
    with pytest.raises(LockHeld, match=f"in use by another run \\(host {socket.gethostname()}, pid"):
        PathLock(tmp_path, stale_after_s=300).acquire()
    os.utime(lock, (time.time() - 400,) * 2)
    taken = PathLock(tmp_path, stale_after_s=300)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        taken.acquire()
    taken.release()
    assert "not refreshed for 400 s" in caplog.text


@pytest.mark.parametrize("fields", [{}, {"pidns": ..., "boot": ...}], ids=["this namespace", "earlier version"])
def test_a_fresh_lock_of_a_gone_process_in_this_pid_namespace_is_taken_over(fields, tmp_path, caplog):
    """In this namespace and boot, or written before the lock named them: a pid no process has is a run gone."""
    _lock_of_this_host(tmp_path, **fields)
    taken = PathLock(tmp_path, stale_after_s=300)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        taken.acquire()
    taken.release()
    assert "its process no longer runs" in caplog.text


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
    "wandb_id a number": b'{"run_dir": "/runs/a", "wandb_id": 5}',
    "not UTF-8": b'{"run_dir": "/runs/r\xffn"}',
    "torn": b'{"run_dir": "/ru',
    "run_dir relative": b'{"run_dir": "../../elsewhere"}',
    "checkpoint_path relative": b'{"run_dir": "/runs/a", "checkpoint_path": "ckpt"}',
    # Hydra would resolve these in hydra.run.dir: the environment read into a path, or a traceback
    "run_dir interpolated": b'{"run_dir": "/tmp/x_${oc.env:HOME}"}',
    "wandb_id interpolated": b'{"run_dir": "/runs/a", "wandb_id": "${oc.env:HOME}"}',
    "added field interpolated": b'{"run_dir": "/runs/a", "later": {"k": ["${now:}"]}}',
    "nested too deeply": b'{"run_dir": "/runs/a", "later": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("content", NOT_RUN_RECORDS.values(), ids=NOT_RUN_RECORDS.keys())
def test_a_run_json_that_is_not_a_run_record_starts_a_new_record(content, tmp_path, caplog):
    (tmp_path / "run.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert recorded_run_dir(str(tmp_path), "outputs/new") == "outputs/new"
        assert not caplog.records  # the Hydra resolver stays silent: the logger warns, once, on rank 0
        assert read_run_record(tmp_path) == {}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{tmp_path / 'run.json'} is not a run record (")
    assert "this invocation starts a new run record" in warning


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_run_json_that_is_not_a_regular_file_starts_a_new_record(kind, tmp_path, caplog):
    """Read without blocking or following it (the Hydra resolver reads it too, on every rank); replaced by the
    new record, a link as a link (its target untouched). A directory is not replaced: a clear ConfigError, and
    no temporary file left beside it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(json.dumps({"run_dir": "/runs/victim"}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    SPECIAL[kind](ckpt / "run.json", tmp_path)
    with within(5), caplog.at_level(logging.WARNING, logger="train"):
        assert recorded_run_dir(str(ckpt), "/runs/new") == "/runs/new"
        assert read_run_record(ckpt) == {}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{ckpt / 'run.json'} is not a run record ({SPECIAL_SAYS[kind]}")
    if kind == "a directory":
        with pytest.raises(ConfigError, match=f"^{ckpt / 'run.json'} is a directory, not a run record.*rm -r"):
            write_run_record(ckpt, {"run_dir": "/runs/new"})
        assert os.listdir(ckpt) == ["run.json"] and (ckpt / "run.json" / "kept").read_text() == "mine"
    else:
        write_run_record(ckpt, {"run_dir": "/runs/new"})
        assert read_run_record(ckpt)["run_dir"] == "/runs/new" and os.listdir(ckpt) == ["run.json"]
    assert json.loads(elsewhere.read_text()) == {"run_dir": "/runs/victim"}


def test_a_run_json_far_larger_than_a_record_is_not_read_whole(tmp_path, caplog):
    (tmp_path / "run.json").write_bytes(b'{"run_dir": "/runs/a", "pad": "' + b"x" * (1 << 20) + b'"}')
    with caplog.at_level(logging.WARNING, logger="train"):
        assert read_run_record(tmp_path) == {}
    assert "is not a run record (it is larger than 1048576 bytes" in caplog.text


def test_a_run_record_reads_back_as_written(tmp_path):
    """With the checkpoint folder it belongs to, absolute and resolved (here reached through a link)."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    record = {"run_dir": "/runs/a", "wandb_id": "0123abcd", "added_later": [1, 2]}
    write_run_record(tmp_path / "alias", record)
    written = record | {"checkpoint_path": str((tmp_path / "real").resolve())}
    assert json.loads((tmp_path / "real" / "run.json").read_text()) == written
    assert read_run_record(tmp_path / "alias") == written and recorded_run_dir(str(tmp_path / "real"), "x") == "/runs/a"
    write_run_record(tmp_path / "real", {"run_dir": "/runs/b", "wandb_id": None})
    assert read_run_record(tmp_path / "real") == {"run_dir": "/runs/b", "checkpoint_path": written["checkpoint_path"]}


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_copied_or_moved_checkpoint_folder_starts_its_own_run_directory(how, tmp_path, caplog):
    """The copy's run.json still names the original run's directory: following it, the copy's run would replace
    that run's resolved_config.yaml and rewrite its metrics history. It starts a new run directory instead,
    with a warning naming both folders; the original run keeps its own."""
    original, copy = tmp_path / "ckpt", tmp_path / "copy"
    first_dir, new_dir = tmp_path / "run", tmp_path / "new_run"
    history = "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 7))
    first_dir.mkdir()
    (first_dir / "metrics.jsonl").write_text(history)
    write_run_record(original, {"run_dir": str(first_dir), "wandb_id": "0123abcd"})
    (shutil.copytree if how == "copied" else shutil.move)(original, copy)
    assert recorded_run_dir(str(copy), str(new_dir)) == str(new_dir)  # hydra.run.dir
    new_dir.mkdir()
    logger = MetricsLogger(new_dir, LoggerConfig(stdout=False), True, {}, str(copy))
    with caplog.at_level(logging.WARNING, logger="train"):
        logger.open(start_step=4, resumed=True)
    logger.close()
    assert (
        f"{copy / 'run.json'} was written for the checkpoint folder {original.resolve()}, not for "
        f"{copy.resolve()} (a copy of it, or moved here): this invocation does not write to that run's "
        f"directory {first_dir}"
    ) in caplog.text
    assert (first_dir / "metrics.jsonl").read_text() == history and os.listdir(first_dir) == ["metrics.jsonl"]
    assert read_run_record(copy) == {"run_dir": str(new_dir.resolve()), "checkpoint_path": str(copy.resolve())}
    if how == "copied":
        assert read_run_record(original)["run_dir"] == str(first_dir)  # the original still follows its own


def test_a_run_json_of_the_previous_version_starts_a_new_record(tmp_path, caplog):
    """Written before run.json named its checkpoint folder, a record cannot tell the folder it was written in
    from a copy of it (a copy would write into the original run's directory): not followed, with a warning
    naming the directory it names; the new record names its folder."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "run.json").write_text(json.dumps({"run_dir": "/runs/a", "wandb_id": "0123abcd"}))
    assert recorded_run_dir(str(tmp_path / "ckpt"), "/runs/new") == "/runs/new"
    with caplog.at_level(logging.WARNING, logger="train"):
        assert read_run_record(tmp_path / "ckpt") == {}  # MetricsLogger.open reads it so and warns
    assert (
        f"{tmp_path / 'ckpt' / 'run.json'} was written by an earlier version of this tool, without the checkpoint "
        "folder it belongs to"
    ) in caplog.text and "(/runs/a)" in caplog.text


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
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(
        f"resuming at step 4, but the metrics history of earlier invocations (steps up to 4) "
        f"is not in {run_dir / 'metrics.jsonl'}"
    )
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


@pytest.mark.parametrize("linked", ["metrics.jsonl", "metrics.superseded.jsonl"])
def test_metrics_files_that_are_symbolic_links_stop_the_run_untouched(linked, tmp_path):
    """run.json may name a run directory someone else prepared: a link there to a file only this user may read
    would be copied, on resuming, into a readable metrics.superseded.jsonl, or be appended to. The run stops
    (ConfigError: exit code 2) naming the link, before reading or writing anything."""
    secret = tmp_path / "secret"
    secret.write_text('{"step": 9, "key": "victim-secret"}\n')
    secret.chmod(0o600)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if linked != "metrics.jsonl":
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 9}\n')
    os.symlink(secret, run_dir / linked)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    logger = MetricsLogger(run_dir, LoggerConfig(stdout=False), True, {}, str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=f"^{run_dir / linked} is a symbolic link \\(to {secret}\\)"):
        logger.open(start_step=4, resumed=True)
    with pytest.raises(ConfigError, match=f"^{run_dir / linked} is a symbolic link"):
        keep_history_up_to(run_dir / "metrics.jsonl", 4)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert secret.read_text() == '{"step": 9, "key": "victim-secret"}\n'


def test_metrics_jsonl_linked_after_the_start_is_not_appended_to(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, LoggerConfig(stdout=False), True, {}, str(tmp_path / "ckpt"))
    logger.open(start_step=0, resumed=False)
    (tmp_path / "target").write_text("")
    os.symlink(tmp_path / "target", run_dir / "metrics.jsonl")
    with pytest.raises(ConfigError, match="metrics.jsonl is a symbolic link"):
        logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert (tmp_path / "target").read_text() == ""


def test_lines_that_are_not_records_move_aside_byte_for_byte(tmp_path):
    """One non-UTF-8 byte, a JSON array, a step that is text or a bool: moved aside unchanged, and the
    resume goes on (before, the first of these stopped every resume with UnicodeDecodeError)."""
    lines = [
        b'{"step": 1, "loss": 2.0}',
        b'{"step": 2, "note": "caf\xe9"}',
        b'{"step": 2, "loss": 1.5}',
        b"[1, 2]",
        b'{"step": "3", "loss": 1.2}',
        b'{"step": true}',
        b'{"step": 3, "loss": 1.1}',
        b'{"step": 4, "lo',
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b"\n".join(lines))  # the last line torn: no newline
    assert keep_history_up_to(metrics, 2) == 6
    assert metrics.read_bytes() == lines[0] + b"\n" + lines[2] + b"\n"
    assert (tmp_path / SUPERSEDED).read_bytes() == b"".join(line + b"\n" for line in lines[1:2] + lines[3:])
    assert keep_history_up_to(metrics, 2) == 0


# ----------------------------------------------------------------------------- Hugging Face folders

SETTINGS = {
    "hidden_size": 16,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_query_groups": 1,
    "ffn_hidden_size": 24,
    "seq_length": 8,
    "norm_epsilon": 1e-5,
    "tie_embeddings": False,
    "rotary_base": 10000.0,
    "init_std": 0.02,
    "vocab_size": 32,
}


@pytest.fixture
def llama(tmp_path) -> Path:
    """A tiny Llama folder, as `checkpoint.py to-hf` writes it (random weights)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file(
        {name: torch.randn(shape, generator=generator) for name, shape in llama_shapes(SETTINGS).items()},
        str(folder / "model.safetensors"),
    )
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


@pytest.mark.parametrize(
    "change,named",
    [
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
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_a_config_json_field_of_the_wrong_type_or_range_is_refused(change, named, llama, tmp_path):
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps(config | change))
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'config.json'}: ") and named in error


@pytest.mark.parametrize(
    "content,named",
    [
        (b"[1]", "Input should be an object"),
        (b'{"model_type": "ll\xffama"}', "Invalid JSON"),
        (b"", "Invalid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "Invalid JSON: recursion limit exceeded"),  # was a RecursionError traceback
        (b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion limit exceeded"),
    ],
    ids=["array", "not_utf8", "empty", "nested_too_deeply", "a_field_nested_too_deeply"],
)
def test_a_config_json_that_is_not_a_json_object_is_refused(content, named, llama, tmp_path):
    (llama / "config.json").write_bytes(content)
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'config.json'}: ") and named in error


@pytest.mark.slow
def test_a_step_folders_config_nested_too_deeply_is_one_line_for_to_hf(tmp_path):
    """to-hf reads the recipe of a step folder's config.yaml before anything else (it was a RecursionError there)."""
    step = tmp_path / "step_1"
    step.mkdir()
    (step / "config.yaml").write_text("recipe: gpt\nmodel: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(SystemExit) as stopped:
        checkpoint_cli(["to-hf", str(step), str(tmp_path / "hf")])
    assert str(stopped.value) == f"error: {step / 'config.yaml'}: not a YAML config (nested too deeply)"


def _shard(folder: Path) -> tuple[Path, dict[str, str]]:
    """The weights as one shard with an index, as save_pretrained writes large models."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = llama_shapes(SETTINGS)
    return folder / "model.safetensors.index.json", {name: "model-00001-of-00001.safetensors" for name in names}


def test_a_well_formed_shard_index_reads(llama):
    index, weight_map = _shard(llama)
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert set(read_hf_weights(llama)) == set(weight_map)


@pytest.mark.parametrize(
    "changed,named",
    [
        ("{outside}", "weight_map='{outside}': Input should be a valid dictionary"),
        (
            {"model.norm.weight": "../outside.safetensors"},
            "weight_map.model.norm.weight='../outside.safetensors': should be the name of a file in the model folder",
        ),
        ({"model.norm.weight": "{outside}"}, "weight_map.model.norm.weight='{outside}'"),
        ({"model.norm.weight": "llama/model-00001-of-00001.safetensors"}, "='llama/model-00001-of-00001.safetensors'"),
        ({"model.norm.weight": ".."}, "weight_map.model.norm.weight='..'"),
        ({"model.norm.weight": 1}, "weight_map.model.norm.weight=1: Input should be a valid string"),
        ({}, "weight_map={{}}: Dictionary should have at least 1 item"),
        (
            {"model.norm.weight": "model-00002-of-00002.safetensors"},
            "names model-00002-of-00002.safetensors, not a file",
        ),
    ],
    ids=["not_an_object", "parent", "absolute", "subfolder", "dotdot", "not_a_name", "empty", "absent_shard"],
)
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


@pytest.mark.parametrize(
    "content,named",
    [
        ([1, 2], "holds list, not a state dict (tensor names to tensors); nothing was imported"),
        ({"model.embed_tokens.weight": 5}, "'model.embed_tokens.weight' holds int, not a tensor"),
        ({"model.embed_tokens.weight": {"x": torch.zeros(1)}}, "'model.embed_tokens.weight' holds dict, not a tensor"),
        ({3: torch.zeros(1)}, "key 3 is not a string"),
    ],
    ids=["list", "dict_of_int", "dict_of_dict", "int_key"],
)
def test_a_pytorch_model_bin_that_is_not_a_state_dict_is_refused_by_name(content, named, llama, tmp_path):
    (llama / "model.safetensors").unlink()
    torch.save(content, llama / "pytorch_model.bin")
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'pytorch_model.bin'}: ") and named in error


def test_a_pytorch_model_bin_state_dict_reads(llama):
    weights = read_hf_weights(llama)
    (llama / "model.safetensors").unlink()
    torch.save(weights, llama / "pytorch_model.bin")
    assert read_hf_weights(llama).keys() == weights.keys()


def test_a_damaged_safetensors_file_is_refused_by_name(llama, tmp_path):
    (llama / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    error = _from_hf_error(llama, tmp_path / "w.safetensors")
    assert error.startswith(f"error: {llama / 'model.safetensors'}: cannot read as safetensors")


def test_a_recorded_run_directory_is_followed_only_when_it_is_safe_to_write(tmp_path, caplog):
    """Whoever can write the checkpoint folder can write run.json: the directory it names is not followed when it,
    or a file a run writes in it, is a symbolic link (a run would write its logs through it)."""
    from core.config.run_record import read_run_record, write_run_record

    ckpt, run_dir, victim = tmp_path / "ckpt", tmp_path / "run", tmp_path / "victim.txt"
    run_dir.mkdir()
    write_run_record(ckpt, {"run_dir": str(run_dir)})
    assert read_run_record(ckpt)["run_dir"] == str(run_dir)
    victim.write_text("mine")
    (run_dir / "train.log").symlink_to(victim)
    with caplog.at_level("WARNING"):
        assert read_run_record(ckpt) == {}
    assert "train.log in it is a symbolic link" in caplog.text
    (run_dir / "train.log").unlink()
    linked = tmp_path / "linked_run"
    linked.symlink_to(run_dir)
    write_run_record(ckpt, {"run_dir": str(linked)})
    assert read_run_record(ckpt, warn=False) == {}
    write_run_record(ckpt, {"run_dir": str(tmp_path / "gone")})  # recreated: the logger says the history is missing
    assert read_run_record(ckpt)["run_dir"] == str(tmp_path / "gone")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_recorded_run_directory_of_another_user_is_not_followed(tmp_path):
    from core.config.run_record import read_run_record, write_run_record

    run_dir = tmp_path / "theirs"
    run_dir.mkdir()
    os.chown(run_dir, 4242, -1)
    write_run_record(tmp_path / "ckpt", {"run_dir": str(run_dir)})
    assert read_run_record(tmp_path / "ckpt", warn=False) == {}
