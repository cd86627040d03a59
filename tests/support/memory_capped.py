"""Run a script as `python <script> <args>` would, with a ceiling on the memory it can take, and record its peak:
`python tests/support/memory_capped.py <report.json> <MiB> <script> <args>...`.

The ceiling is an address-space limit (RLIMIT_AS) of what the process has mapped when it starts plus <MiB>, so a
load that asks for gigabytes fails at once (MemoryError) instead of taking a machine shared with others. The
report holds the peak resident size in KiB (`peak_kib`, the kernel's ru_maxrss of this process) when it ends."""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
from pathlib import Path


def mapped_bytes() -> int:
    """The process's virtual size (VmSize) now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    import torch  # noqa: F401  (mapped before the ceiling is measured, in a fresh interpreter too)

    report, mib, *argv = sys.argv[1:]
    limit = mapped_bytes() + (int(mib) << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def write_report() -> None:
        Path(report).write_text(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))

    def exit_reporting(code: int) -> None:
        write_report()
        leave(code)

    # However the script ends: the interpreter's exit, or os._exit (train.py's launcher skips the teardown).
    atexit.register(write_report)
    leave, os._exit = os._exit, exit_reporting
    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python <script>` has it
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
