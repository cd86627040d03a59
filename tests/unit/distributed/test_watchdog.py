"""core/distributed/watchdog.py: a rank started by torchrun ends when torchrun is gone (as an orphan it would go on
training and writing checkpoints); the end-to-end case (torchrun killed) is tests/e2e/test_failing_jobs.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support.helpers import REPO

RANK = """
import os, sys, time
sys.path.insert(0, {repo!r})
os.environ.update(TORCHELASTIC_RUN_ID="test", LOCAL_RANK="0", RANK="3")
from core.distributed.watchdog import exit_with_launcher
exit_with_launcher(poll_s=0.05)
open({ready!r}, "w").write(str(os.getpid()))
time.sleep(60)
"""

LAUNCHER = """
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", {rank!r}], stderr=open({log!r}, "w"))
while not os.path.exists({ready!r}):
    time.sleep(0.01)
os._exit(0)  # gone without waiting for its rank, as after kill -9
"""


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_rank_whose_launcher_is_gone_ends_with_an_error(tmp_path):
    ready, log = tmp_path / "ready", tmp_path / "rank.log"
    rank = RANK.format(repo=str(REPO), ready=str(ready))
    subprocess.run(
        [sys.executable, "-c", LAUNCHER.format(rank=rank, log=str(log), ready=str(ready))], timeout=60, check=True
    )
    pid = int(ready.read_text())
    deadline = time.time() + 20
    while _running(pid):
        assert time.time() < deadline, "the rank went on running after its launcher was gone"
        time.sleep(0.05)
    assert "rank 3: the launcher (pid" in log.read_text() and "is gone; stopping" in log.read_text()


def test_no_watch_without_torchrun(monkeypatch):
    from core.distributed import watchdog

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delattr(watchdog.exit_with_launcher, "started", raising=False)
    watchdog.exit_with_launcher(poll_s=0.05)
    assert not getattr(watchdog.exit_with_launcher, "started", False)  # a plain `python train.py` has no launcher
