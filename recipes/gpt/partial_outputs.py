"""A preprocess run's outputs while it writes them: `<prefix>.tmp-<tag>.bin/.idx/.json` (`<tag>`: the writing
process, core/data/partial_outputs.py), renamed to `<prefix>.*` once whole (the .json last: its presence means the
others are whole).

They are removed when the run fails or is stopped by SIGTERM or SIGHUP (then `Stopped` is raised; a signal that
was ignored, as nohup ignores SIGHUP, stays ignored). What a run killed outright left (SIGKILL, a lost node) is
removed by the next run for the same prefix once its writer provably ended; files of a live process, or of
another host or container, are left alone. Leftovers named `<prefix>.tmp-<host>-<pid>.*` or `<prefix>.tmp-<pid>.*`,
as earlier versions named them, are judged by host and pid (the latter as this host's).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

from core.data.partial_outputs import RaisingStopSignals, ended_leftovers, tagged_name

log = logging.getLogger(__name__)

SUFFIXES = (".bin", ".idx", ".json")
TEMPORARY = ".tmp-"


def temporary_prefix(prefix: Path) -> Path:
    return tagged_name(prefix, TEMPORARY)


def remove_leftovers(prefix: Path) -> None:
    """Remove what killed runs left for `prefix` (see the module's text), saying so in one line."""
    gone: dict[int, list[Path]] = {}
    for path, writer in ended_leftovers(prefix, TEMPORARY, SUFFIXES):
        if path.is_file():
            path.unlink(missing_ok=True)
            gone.setdefault(writer.pid, []).append(path)
    if gone:
        log.warning(
            "removed what an interrupted preprocess left (process%s %s gone from this host): %s",
            "es" if len(gone) > 1 else "",
            ", ".join(map(str, gone)),
            ", ".join(str(p) for paths in gone.values() for p in paths),
        )


@contextlib.contextmanager
def partial_outputs(tmp: Path) -> Iterator[Callable[[Path], None]]:
    """Write `<tmp>.bin/.idx/.json` inside; the function it gives renames them to a prefix's (all three, or none:
    the stop signals are held meanwhile). On leaving, what is left of them is removed, the stop signals held."""
    signals = RaisingStopSignals()

    def commit(prefix: Path) -> None:
        signals.hold()
        for suffix in SUFFIXES:
            os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")

    try:
        yield commit
    finally:
        signals.hold()
        for suffix in SUFFIXES:
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        signals.restore()
