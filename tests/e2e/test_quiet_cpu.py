"""Quiet on a CPU: the tools print no warnings about CUDA, Apex or TransformerEngine that a CPU user cannot act on,
and loader workers beyond the cores are cut to them, said once."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from core.data import loading
from tests.support.helpers import REPO

NOISE = ("CUDA_HOME", "Apex", "Transformer Engine", "Detected Megatron Core")


@pytest.mark.slow
def test_gpt_preprocess_and_decode_print_no_cuda_apex_or_te_warnings(tmp_path):
    """A fresh interpreter (Megatron-Core's warnings come once per process, at its import)."""
    (tmp_path / "a.txt").write_text("Call me Ishmael.\n\nSome years ago.\n")
    for args in (
        ["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "corpus")],
        ["--decode", str(tmp_path / "corpus"), "--document", "1"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "recipes.gpt.preprocess", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output
        assert not [line for line in output.splitlines() if any(n in line for n in NOISE)], output
    assert output.strip() == "Some years ago."


def test_loader_workers_are_cut_to_this_ranks_share_of_the_cores_said_once(monkeypatch, caplog):
    monkeypatch.setattr(loading.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    loading._note_fewer_workers.cache_clear()
    with caplog.at_level(logging.INFO, logger="core.data.loading"):
        assert [loading.usable_workers(n) for n in (0, 1, 2, 8, 8, 3)] == [0, 1, 2, 2, 2, 2]
    notes = [r.getMessage() for r in caplog.records if "num_workers" in r.getMessage()]
    assert notes == [
        "note: data.num_workers=8 is more than this rank's share of the CPU cores (4 cores, 2 local "
        "ranks): 2 loader workers per rank",
        "note: data.num_workers=3 is more than this rank's share of the CPU cores (4 cores, 2 local "
        "ranks): 2 loader workers per rank",
    ]
    monkeypatch.setenv("RANK", "1")  # another rank: the same cut, no note
    caplog.clear()
    loading._note_fewer_workers.cache_clear()
    assert loading.usable_workers(8) == 2 and not caplog.records
