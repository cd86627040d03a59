"""core/data/partial_outputs.py: which writer of a temporary output has provably ended, the tags its names carry,
and the stop signals raised while an output is written. The recipes' use of it (which files, what the final
rename is, what is said) is tested with each: tests/recipes/esm2/test_store.py,
tests/recipes/gpt/test_data_in_the_wild.py, tests/unit/data/test_samplers_and_image_datasets.py."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from core.data.partial_outputs import (
    RaisingStopSignals,
    Stopped,
    Writer,
    ended_leftovers,
    name_tag,
    parse_tag,
    stop_signal,
    tagged_name,
    this_writer,
    writer_is_gone,
)


@pytest.fixture
def ended_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def live_pid():
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


def test_an_ended_process_of_this_host_namespace_and_boot_is_gone_and_a_live_one_is_not(ended_pid, live_pid):
    me = this_writer()
    assert writer_is_gone(me.model_copy(update={"pid": ended_pid}), me)
    assert not writer_is_gone(me.model_copy(update={"pid": live_pid}), me)
    assert not writer_is_gone(me, me)


def test_another_users_process_is_not_gone(monkeypatch):
    """os.kill refuses to signal it (here faked: these tests may run as root): it exists."""

    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)
    me = this_writer()
    assert not writer_is_gone(me.model_copy(update={"pid": 4242}), me)


def test_another_host_or_pid_namespace_is_never_judged(ended_pid):
    """Its pid names no process here: a writer on a shared file system, or in another container, may be live."""
    me = this_writer()
    for other in ({"host": "node-17"}, {"pidns": "4026532999"}, {"pidns": None}):
        assert not writer_is_gone(me.model_copy(update={"pid": ended_pid} | other), me), other


@pytest.mark.slow
def test_a_reboot_since_ends_every_writer_of_before_unless_a_boot_id_is_unreadable(live_pid):
    me = this_writer()
    assert me.boot is not None and me.pidns is not None, "this test needs /proc"
    before = me.model_copy(update={"pid": live_pid, "boot": "0123abcd-0000-4000-8000-000000000000"})
    assert writer_is_gone(before, me)  # its pid is another process's now
    assert not writer_is_gone(before.model_copy(update={"boot": None}), me)
    assert not writer_is_gone(before, me.model_copy(update={"boot": None}))
    # A name carries the boot id's first group: the same boot, read from a name, is the same boot.
    assert not writer_is_gone(parse_tag(name_tag(me.model_copy(update={"pid": live_pid}))), me)


def test_a_tag_of_an_earlier_version_is_judged_by_what_it_records(ended_pid, live_pid):
    """`<host>-<pid>` and `<pid>` (this host's) recorded no PID namespace or boot: host and pid judge them."""
    me = this_writer()
    assert writer_is_gone(parse_tag(f"{me.host}-{ended_pid}"), me)
    assert writer_is_gone(parse_tag(str(ended_pid)), me)
    assert not writer_is_gone(parse_tag(f"{me.host}-{live_pid}"), me)
    assert not writer_is_gone(parse_tag(str(live_pid)), me)
    assert not writer_is_gone(parse_tag(f"{me.host}x-{ended_pid}"), me)


def test_name_tags_are_read_back_as_written_and_anything_else_is_no_tag():
    me = this_writer()
    assert parse_tag(name_tag(me)) == me.model_copy(update={"boot": me.boot[:8]})
    odd = Writer(pid=42, host="node-7-ns1-boot2", pidns=None, boot=None)  # a host name like a tag; fields unreadable
    assert name_tag(odd) == "node-7-ns1-boot2-42-ns-boot" and parse_tag(name_tag(odd)) == odd
    assert parse_tag("node-7-42") == Writer(pid=42, host="node-7")
    assert parse_tag("42") == Writer(pid=42) and parse_tag("42").model_fields_set == {"pid"}
    for text in ("", "notes", "node-", "-42", "node-0", "node-2147483648", "42x", "node-42-ns1-bootXYZ"):
        assert parse_tag(text) is None, text


def test_ended_leftovers_are_the_tagged_names_of_ended_writers_only(tmp_path, ended_pid, live_pid):
    me = this_writer()
    ended, live = me.model_copy(update={"pid": ended_pid}), me.model_copy(update={"pid": live_pid})
    rebooted = live.model_copy(update={"boot": "0123abcd"})
    container = ended.model_copy(update={"pidns": "4026532999"})
    gone = [
        f"p.tmp-{name_tag(ended)}.bin",
        f"p.tmp-{name_tag(ended)}.idx",
        f"p.tmp-{name_tag(rebooted)}.bin",
        f"p.tmp-{me.host}-{ended_pid}.json",
        f"p.tmp-{ended_pid}.bin",
    ]
    kept = [
        f"p.tmp-{name_tag(live)}.bin",
        f"p.tmp-{name_tag(container)}.bin",
        f"p.tmp-{name_tag(me)}.bin",
        f"p.tmp-{name_tag(ended)}.txt",
        f"p.tmp-{name_tag(ended)}",
        "p.tmp-notes.bin",
        f"q.tmp-{ended_pid}.bin",
        f"p.extracting-{ended_pid}",
    ]
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"partial")
    found = ended_leftovers(tmp_path / "p", ".tmp-", (".bin", ".idx", ".json"))
    assert [path.name for path, _ in found] == sorted(gone)
    assert {writer.pid for _, writer in found} == {ended_pid, live_pid}
    assert [path.name for path, _ in ended_leftovers(tmp_path / "p", ".extracting-")] == [f"p.extracting-{ended_pid}"]


def test_a_tagged_name_is_beside_the_path_and_found_while_its_writer_lives(tmp_path):
    path = tagged_name(tmp_path / "root", ".extracting-")
    assert path.parent == tmp_path and path.name == f"root.extracting-{name_tag(this_writer())}"
    path.mkdir()
    assert parse_tag(path.name.removeprefix("root.extracting-")).pid == os.getpid()
    assert ended_leftovers(tmp_path / "root", ".extracting-") == []


@pytest.fixture
def sigterm_recorded():
    """SIGTERM and SIGHUP as a caller had them: SIGTERM recorded, SIGHUP ignored (as under nohup)."""
    got = []
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum)),
        signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    }
    yield got
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_stop_signal_raises_stopped_once_and_the_handlers_before_come_back(sigterm_recorded):
    signals = RaisingStopSignals()
    with pytest.raises(Stopped, match="^stopped by SIGTERM$") as stopped:
        signal.raise_signal(signal.SIGTERM)
    assert stop_signal(stopped.value) == signal.SIGTERM and stop_signal(KeyboardInterrupt()) == signal.SIGINT
    signal.raise_signal(signal.SIGTERM)  # a second one while the output is removed: not raised again
    signals.restore()
    assert sigterm_recorded == [] and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorded == [signal.SIGTERM]


def test_an_ignored_sighup_stays_ignored(sigterm_recorded):
    signals = RaisingStopSignals()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    signal.raise_signal(signal.SIGHUP)  # nothing happens, as under nohup
    signals.restore()


def test_a_held_stop_signal_waits_then_goes_where_it_would_have(sigterm_recorded):
    signals = RaisingStopSignals()
    signals.hold()  # a rename that must not be cut in two
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_recorded == []
    signals.restore()
    assert sigterm_recorded == [signal.SIGTERM]
