"""A dataset shipped as an archive: `<root>.tar.gz` (`.tgz`, `.tar`) beside a missing `<root>`, extracted there
on first use.

Safe with many ranks and nodes: one process extracts under a file lock (`<root>.lock`) into its own folder
`<root>.extracting-<tag>/` (`<tag>`: the process, core/data/partial_outputs.py) and renames it into place, so
nobody ever sees a half-extracted root. A failed extraction removes its folder and is one DataError naming the
archive. A process killed while extracting cannot clean up: the next one to take the lock removes the folders of
processes that provably ended (never one whose process still runs, nor another host's or container's).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tarfile
import zlib
from pathlib import Path

from core.config.errors import DataError, MissingDataError
from core.config.file_shape import NotThisKindOfFile, open_regular_file
from core.data.partial_outputs import ended_leftovers, tagged_name

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
EXTRACTING = ".extracting-"


def extract_beside(root: str) -> Path:
    """Return `root`; if it is missing but `<root>.tar.gz` (.tgz, .tar) exists, extract it first.
    MissingDataError if there is neither; DataError naming the archive if it cannot be extracted."""
    path = Path(root)
    if path.exists():
        return path
    archive = next((Path(root + s) for s in ARCHIVE_SUFFIXES if Path(root + s).exists()), None)
    if archive is None:
        raise MissingDataError(
            f"no such folder, and no {root}.tar.gz (.tgz, .tar) beside it to extract; give your dataset's folder"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{root}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                remove_leftovers(path)
                _extract(archive, path)
    except OSError as e:  # the folder beside the archive cannot be written
        raise DataError(f"{archive}: cannot be extracted beside it ({e.strerror}: {e.filename})") from None
    return path


def _extract(archive: Path, path: Path) -> None:
    tmp = tagged_name(path, EXTRACTING)
    log.info("extracting %s -> %s", archive, path)
    try:
        # Opened without blocking: a FIFO under the archive's name would hang every rank waiting for the lock.
        with open_regular_file(archive, follow_symlinks=True) as f, tarfile.open(fileobj=f) as tar:
            tar.extractall(tmp, filter="data")  # refuses members that would land outside or link out
        entries = list(tmp.iterdir()) if tmp.is_dir() else []
        if not entries:
            raise DataError(f"{archive}: holds no files")
        # An archive usually holds one top folder (e.g. tiny-imagenet-200/): that folder is the root.
        source = entries[0] if len(entries) == 1 and entries[0].is_dir() else tmp
        if source != tmp:
            _refuse_links_out(archive, source, path)
        os.rename(source, path)
    except NotThisKindOfFile as e:
        raise DataError(f"{archive}: {e}; give the archive as a file, or extract it to {path} yourself") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # cut short, damaged, not an archive, refused
        raise DataError(
            f"{archive}: cannot be extracted ({type(e).__name__}: {e}); replace it, or extract it to {path} yourself"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed extraction left (after success: nothing)


def _refuse_links_out(archive: Path, top: Path, path: Path) -> None:
    """DataError naming the member when `top` (the archive's one top-level entry, to become `path`) is a link or
    holds a link that leads out of it: tarfile's filter keeps links inside the extraction folder, but once `top` is
    renamed into place, that folder is `path`'s parent (a top-level `pets -> .` made the root the folder beside it)."""
    real_top = os.path.realpath(top)
    if top.is_symlink():
        links = [top]
    else:  # os.walk lists links to folders without entering them
        entries = (Path(parent, n) for parent, folders, files in os.walk(top) for n in folders + files)
        links = [entry for entry in entries if entry.is_symlink()]
    for link in links:
        target = os.path.realpath(link)
        if link == top or os.path.commonpath([target, real_top]) != real_top:
            member = link.relative_to(top.parent)
            where = "not the folder" if link == top else "outside the folder"
            raise DataError(
                f"{archive}: its member {member} is a link to {os.readlink(link)}, {where} that would become {path}; "
                f"replace the archive, or extract it to {path} yourself"
            )


def remove_leftovers(path: Path) -> None:
    """Remove the extraction folders beside `path` of processes that provably ended."""
    for entry, writer in ended_leftovers(path, EXTRACTING):
        log.info("removing %s: left by an extraction whose process (%s) is gone", entry, writer.pid)
        shutil.rmtree(entry, ignore_errors=True)  # a link is not followed, nor removed
