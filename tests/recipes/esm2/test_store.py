"""The ESM-2 preprocessed store (recipes/esm2/sequences.py, partial_output.py, preprocess.py) as a careless user
or a hostile file would have it: damaged files refused in one line, a store sent to loader workers as its folder,
and preprocess runs that meet at one output folder."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from core.config.errors import DataError
from recipes.esm2 import preprocess
from recipes.esm2.masking import Masking
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import read_store, write_store
from tests.support.helpers import REPO, run_python

NAMED = [(f"P{i}", "MKTAYIAKQRQISFVKSHFSRQ"[: 5 + i % 17] * (1 + i % 3)) for i in range(40)]


def make_store(folder: Path) -> Path:
    write_store(iter(NAMED), folder, "test")
    return folder


def rewrite_index(store: Path, **changes) -> None:
    index = json.loads((store / "index.json").read_text())
    (store / "index.json").write_text(json.dumps(index | changes))


def save_offsets(store: Path, offsets: np.ndarray, **np_save) -> None:
    import hashlib

    np.save(store / "offsets.npy", offsets, **np_save)
    if offsets.dtype == np.int64:
        rewrite_index(store, offsets_sha256=hashlib.sha256(offsets).hexdigest())


def _missing(store):
    (store / "offsets.npy").unlink()


def _garbage(store):
    (store / "offsets.npy").write_bytes(b"\x93NUMPY not really" + os.urandom(64))


def _object_typed(store):
    np.save(store / "offsets.npy", np.array([0, "x", None], dtype=object), allow_pickle=True)


def _not_increasing(store):
    offsets = np.load(store / "offsets.npy")
    offsets[3], offsets[4] = offsets[4], offsets[3]
    save_offsets(store, offsets)  # with its hash recorded: only the order check can tell


def _past_the_residues(store):
    offsets = np.load(store / "offsets.npy")
    offsets[-1] += 1000
    save_offsets(store, offsets)


DAMAGE = {  # (damage, what the one line says after "data.path=<store>: ")
    "offsets missing": (_missing, "offsets.npy is missing or not a file"),
    "offsets garbage": (_garbage, "offsets.npy is not a NumPy array of offsets"),
    "offsets of objects": (_object_typed, "offsets.npy is not a NumPy array of offsets .*(pickle|objects)"),
    "offsets not increasing": (_not_increasing, "offsets.npy does not increase at sequence 3"),
    "offsets past the residues": (_past_the_residues, "offsets.npy runs from 0 to \\d+, not from 0 to index.json's"),
    "sequences 1e400": (
        lambda s: (s / "index.json").write_text(
            (s / "index.json").read_text().replace('"sequences": 40', '"sequences": 1e400')
        ),
        "sequences=inf",
    ),
    "sequences negative": (lambda s: rewrite_index(s, sequences=-1), "sequences=-1"),
    "sequences a float": (lambda s: rewrite_index(s, sequences=40.0), "sequences=40.0"),
    "sequences huge": (lambda s: rewrite_index(s, sequences=10**30), "sequences=1000000000000000000000000000000"),
    "sequences inconsistent": (
        lambda s: rewrite_index(s, sequences=39),
        r"offsets.npy holds int64 \(41,\), expected int64 \(40,\) for index.json's sequences=39",
    ),
    "index nested deep": (lambda s: (s / "index.json").write_text("[" * 100_000), "recursion limit"),
    # names.txt is read whole when a name is asked for: a sparse file of 8 GiB (no disk blocks) or a FIFO is not
    "names sparse": (lambda s: os.truncate(s / "names.txt", 8 << 30), "names.txt is 8589934592 bytes, far more"),
    "names a FIFO": (lambda s: ((s / "names.txt").unlink(), os.mkfifo(s / "names.txt")), "names.txt is not a regular"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_store_is_refused_in_one_line_naming_the_setting_and_file(tmp_path, damage):
    store = make_store(tmp_path / "store")
    harm, says = DAMAGE[damage]
    harm(store)
    with pytest.raises(DataError) as refused:
        read_store(store)
    message = str(refused.value)
    assert "\n" not in message
    assert re.match(f"data.path={re.escape(str(store))}: .*{says}", message), message
    assert message.endswith("write the folder again with python -m recipes.esm2.preprocess"), message


@pytest.mark.slow
def test_a_damaged_store_ends_train_with_one_line_and_exit_2(tmp_path):
    """Through train.py (data.val_path: the setting is named): `data error: ...`, exit code 2, no traceback."""
    store = make_store(tmp_path / "val_store")
    _garbage(store)
    result = run_python(
        "train.py",
        "--config-name",
        "esm2_sanity",
        f"data.val_path={store}",
        f"checkpoint.path={tmp_path}/ckpt",
        "training.steps=1",
        "logger.progress_bar=never",
        f"hydra.run.dir={tmp_path}/run",
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "Traceback" in line or "error" in line]
    assert len(errors) == 1 and re.search(
        f"data error: data.val_path={re.escape(str(store))}: offsets.npy is not a NumPy array", errors[0]
    ), errors


def test_a_preprocessed_store_pickles_as_its_folder_and_refuses_one_written_again(tmp_path):
    """A forkserver/spawn loader worker gets the store's folder, not a copy of every residue; it maps the same files
    and refuses a folder written again or removed since the main process checked it."""
    store = tmp_path / "store"
    write_store(((f"L{i}", "MKTAYIAKQR" * (100 + i)) for i in range(40)), store, "test")  # 47,800 residues
    opened = read_store(store)
    payload = pickle.dumps(opened)
    assert len(payload) < 1000, len(payload)
    again = pickle.loads(payload)
    assert np.array_equal(np.asarray(again.residues), np.asarray(opened.residues))
    assert again.name(7) == "L7" and again.source == f"data.path={store}"
    packs = PackedSequences(opened, np.arange(len(opened)), 256, 64, 8, Masking(), seed=1, shuffle_seed=2)
    assert len(pickle.dumps(packs)) < 3000
    assert all(
        np.array_equal(pickle.loads(pickle.dumps(packs))[k]["tokens"], packs[k]["tokens"]) for k in range(len(packs))
    )

    import shutil

    shutil.rmtree(store)
    with pytest.raises(
        DataError, match=f"data.path={re.escape(str(store))}: the store was removed after this run opened it"
    ):
        pickle.loads(payload).sequence(0)
    write_store(iter(NAMED[::-1]), store, "test")  # the same folder name, other contents
    with pytest.raises(DataError, match=f"data.path={re.escape(str(store))}: the store was written again"):
        pickle.loads(pickle.dumps(packs))[0]


@pytest.mark.slow
def test_a_loader_worker_refuses_a_store_written_again_in_one_line(tmp_path):
    """A forkserver loader worker maps the store itself; one written again since the run opened it reaches the main
    process as the DataError's one line, not as "worker exited unexpectedly"."""
    import torch

    from core.config.errors import message_of

    store = make_store(tmp_path / "store")
    packs = PackedSequences(read_store(store), np.arange(len(NAMED)), 256, 64, 8, Masking(), seed=1, shuffle_seed=2)
    loader = torch.utils.data.DataLoader(packs, batch_size=2, num_workers=1, multiprocessing_context="forkserver")
    assert torch.equal(next(iter(loader))["tokens"][1], packs[1]["tokens"])
    import shutil

    shutil.rmtree(store)
    write_store(iter(NAMED[::-1]), store, "test")
    with pytest.raises(DataError) as refused:
        next(iter(loader))
    assert message_of(refused.value) == (
        f"data.path={store}: the store was written again (its files changed) after "
        "this run opened it; start the run again (in a data loader worker)"
    )


# --- preprocess runs that meet at one --out --------------------------------------------------------
@pytest.mark.slow
def test_a_second_run_to_the_same_out_is_refused_while_the_first_writes(tmp_path):
    """The second run (another process, started while the first is writing) refuses in one line naming the first;
    the first completes, and nothing of either is left behind."""
    (tmp_path / "x.fasta").write_text(">a\nMKV\n")
    out, second = tmp_path / "store", []

    def records_meanwhile_a_second_run():
        yield "first", "MKTAYIAK"
        second.append(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "recipes.esm2.preprocess",
                    "--input",
                    str(tmp_path / "x.fasta"),
                    "--out",
                    str(out),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
        )
        yield "second", "LLAGG"

    index = write_store(records_meanwhile_a_second_run(), out, "test")
    refused = second[0]
    assert refused.returncode == 2, refused
    assert re.fullmatch(
        f"error: --out {re.escape(str(out))}: another run is writing it \\(pid {os.getpid()} on "
        f".*into {re.escape(str(out))}.partial-{os.getpid()}\\); wait for it, or give another "
        "folder\n",
        refused.stderr,
    ), refused.stderr
    assert index["sequences"] == 2 and read_store(out).name(1) == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "x.fasta"]


def _writer(pid: int, **changes) -> str:
    """writer.json of a run with `pid` on this host (as recipes/esm2/partial_output.py writes it), changed."""
    import socket

    record = {
        "host": socket.gethostname(),
        "pid": pid,
        "pidns": str(os.stat("/proc/self/ns/pid").st_ino),
        "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "since_ns": time.time_ns(),
    }
    return json.dumps(record | changes)


def _ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_ended_runs_are_removed_saying_so_and_nothing_else(tmp_path, capsys):
    (tmp_path / "x.fasta").write_text(">a\nMKV\n")
    out = tmp_path / "store"
    ended = out.with_name(f"store.partial-{_ended_pid()}")  # a run killed with SIGKILL
    ended.mkdir()
    (ended / "writer.json").write_text(_writer(int(ended.name.rsplit("-", 1)[1])))
    (ended / "residues.bin").write_bytes(b"\x05" * 100)
    rebooted = out.with_name("store.partial-1")  # a run of this host before a reboot, with a user's file in it
    rebooted.mkdir()
    (rebooted / "writer.json").write_text(_writer(1, boot="another-boot"))
    (rebooted / "names.txt").write_text("a\n")
    (rebooted / "my_notes.txt").write_text("keep me")
    same_pid = out.with_name(f"store.partial-{os.getpid()}")  # an ended run whose pid this process has now
    same_pid.mkdir()
    (same_pid / "writer.json").write_text(_writer(os.getpid(), since_ns=time.time_ns() - 10**12))
    (same_pid / "offsets.npy").write_bytes(b"\x93NUMPY")
    users = out.with_name("store.partial-mine")  # not this tool's: no writer record
    users.mkdir()
    (users / "residues.bin").write_text("keep me too")

    preprocess.main(["--input", str(tmp_path / "x.fasta"), "--out", str(out)])
    err = capsys.readouterr().err
    assert f"note: removed {ended}: the partial output of a run (pid" in err
    assert f"note: removed what this tool wrote in {rebooted}:" in err and "other files there were left" in err
    assert f"note: removed {same_pid}: the partial output of a run (pid {os.getpid()}" in err
    assert not ended.exists() and sorted(p.name for p in rebooted.iterdir()) == ["my_notes.txt"]
    assert (users / "residues.bin").read_text() == "keep me too"
    assert len(read_store(out)) == 1


def test_a_partial_output_that_cannot_be_judged_is_left_and_refused(tmp_path, capsys):
    """Another host writing the same --out on a shared filesystem: its pid says nothing here."""
    (tmp_path / "x.fasta").write_text(">a\nMKV\n")
    out = tmp_path / "store"
    other = out.with_name("store.partial-4242")
    other.mkdir()
    (other / "writer.json").write_text(_writer(4242, host="node-17"))
    with pytest.raises(SystemExit) as stop:
        preprocess.main(["--input", str(tmp_path / "x.fasta"), "--out", str(out)])
    assert stop.value.code == 2
    assert re.fullmatch(
        f"error: --out {re.escape(str(out))}: another run is writing it \\(pid 4242 on node-17, "
        f"since .*, into {re.escape(str(other))}\\) \\(if that run has ended, remove "
        f"{re.escape(str(other))}\\); wait for it, or give another folder\n",
        capsys.readouterr().err,
    )
    assert (other / "writer.json").exists() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store.partial-4242", "x.fasta"]


def test_of_two_runs_that_start_together_the_later_refuses(tmp_path):
    """Two runs that each see the other's partial folder (both created before either looked again): the one whose
    writer record says it started later refuses, the other goes on."""
    from recipes.esm2.partial_output import PartialFolder

    out = tmp_path / "store"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a live writer
    try:
        peer = out.with_name(f"store.partial-{other.pid}")
        peer.mkdir()
        with PartialFolder(out, ("residues.bin",), "--out", print) as mine:
            me = (mine.me.since_ns, mine.me.host, mine.me.pid)
            (peer / "writer.json").write_text(_writer(other.pid, since_ns=mine.me.since_ns + 1))
            mine._refuse_live_writers(me)  # it started later: it refuses, this one goes on
            (peer / "writer.json").write_text(_writer(other.pid, since_ns=mine.me.since_ns - 1))
            with pytest.raises(DataError, match=f"another run is writing it \\(pid {other.pid} on "):
                mine._refuse_live_writers(me)
        assert sorted(p.name for p in tmp_path.iterdir()) == [peer.name]  # this run's folder removed, not the other's
    finally:
        other.kill()
        other.wait()


@pytest.mark.slow
def test_sigterm_while_writing_removes_the_partial_output(tmp_path):
    (tmp_path / "x.fasta").write_text(">a\nMKV\n")
    out = tmp_path / "store"
    script = textwrap.dedent(f"""
        import time
        from recipes.esm2 import preprocess

        def slow_records(*args):  # a large input: still reading when the signal comes
            yield "a", "MKV"
            time.sleep(120)

        preprocess.records = slow_records
        preprocess.main(["--input", {str(tmp_path / "x.fasta")!r}, "--out", {str(out)!r}])
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("store.partial*/residues.bin")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("store.partial*/residues.bin")), "the run wrote nothing"
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and err == "error: stopped by SIGTERM; nothing was written\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.fasta"]
