"""A folder tree walked as datasets are assembled in the wild: links followed, each real folder visited once
(image folders, scripts/shard_images.py, predict.folder; ESM-2's sequence folders).

Datasets are often put together from links (`train/cat -> /data/cats`, `cp -rs`), so links to folders are
followed. But a link to a folder already visited, or to one above the walk (`train/a/self -> .`,
`up -> ..`), would list the same images again and again (os.walk(followlinks=True) repeats a `self -> .`
link until the path is too long, and two `..` links grow without end): such a link is not followed, and is
named once in a warning. Real folders are visited before the links, so a file reached both ways is listed
under its real path. Linked files are files like any other.
"""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

log = logging.getLogger(__name__)

# The links already named in a warning: a tree is walked more than once (its classes, then their files).
_named: set[str] = set()


def visible(name: str) -> bool:
    return not name.startswith(".")


def folder_key(path: Path) -> tuple[int, int]:
    """What makes a folder the same folder whatever path reaches it: (device, inode), links followed."""
    status = os.stat(path)
    return status.st_dev, status.st_ino


def real_ancestors(folder: Path) -> set[tuple[int, int]]:
    """The keys of `folder` and of every folder above its real path: a link to one of them is a loop."""
    real = Path(os.path.realpath(folder))
    keys = set()
    for path in (real, *real.parents):
        try:
            keys.add(folder_key(path))
        except OSError:  # not there, or not ours to look at: nothing a link could loop through
            pass
    return keys


def name_loops(where: Path, links: list[Path]) -> None:
    """One warning naming the links (and their targets) not followed, each link once per process."""
    new = [link for link in links if str(link) not in _named]
    _named.update(str(link) for link in new)
    if new:
        shown = ", ".join(f"{link} -> {_target(link)}" for link in new[:5])
        log.warning(
            "%s: did not follow links to folders visited already (a loop, or a second way to the same images): %s%s",
            where,
            shown,
            f" and {len(new) - 5} more" if len(new) > 5 else "",
        )


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # links followed
    except OSError:  # e.g. a link to itself: not a folder (and not an image)
        return False


def walk(
    folder: Path, stop: Optional[Callable[[Path], bool]] = None, taken: Optional[set[tuple[int, int]]] = None
) -> Iterator[tuple[Path, list[str]]]:
    """(folder, the names of its visible entries that are not folders) for `folder` and each visible folder
    under it, links to folders followed, each real folder once (links named in a warning when they lead to a
    folder visited already or above `folder`). A folder that cannot be listed is left out, logged. A folder
    for which `stop(folder)` holds is yielded with no names and not entered (its caller reads it whole).
    `taken`: the keys of folders that walks before this one listed or that belong to others (a split's other
    class folders), not entered; the walk adds those it visits, so walks sharing it list each real folder once."""
    seen = real_ancestors(folder)
    if taken is not None:
        taken |= seen
        seen = taken
    real: list[Path] = [folder]
    links: collections.deque[Path] = collections.deque()
    repeated: list[Path] = []
    while real or links:
        if real:
            current = real.pop()
        else:
            current = links.popleft()
            try:
                key = folder_key(current)
            except OSError:  # gone since it was listed
                continue
            if key in seen:
                repeated.append(current)
                continue
            seen.add(key)
        if stop is not None and stop(current):
            yield current, []
            continue
        try:
            with os.scandir(current) as scan:
                entries = sorted(scan, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):  # e.g. a class without an images/ folder: nothing there
            continue
        except OSError as e:
            log.warning("%s: left out, it cannot be listed (%s)", current, e.strerror)
            continue
        names = []
        for entry in entries:
            if not visible(entry.name):
                continue
            if not _is_folder(entry):
                names.append(entry.name)
            elif entry.is_symlink():
                links.append(current / entry.name)
            else:
                status = entry.stat(follow_symlinks=False)
                key = status.st_dev, status.st_ino
                if key in seen:  # a bind mount of a folder above
                    repeated.append(current / entry.name)
                else:
                    seen.add(key)
                    real.append(current / entry.name)
        yield current, names
    if repeated:
        name_loops(folder, repeated)
