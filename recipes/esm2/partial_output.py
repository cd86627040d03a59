"""A folder written by one process at a time: its files go into `<out>.partial-<pid>` and the folder is renamed
to `<out>` when complete, so `<out>` appears whole or not at all.

Two runs to one `<out>` (a second terminal, a job array): the later one refuses, naming the writer, before it
writes anything; each run only ever removes its own partial folder, on an error, Ctrl-C, SIGTERM or SIGHUP. A
partial folder whose writer provably ended (core/data/partial_outputs.py: this host, the same PID namespace and
boot, and no such process; or this host rebooted since) is removed by the next run, which says so. One whose
writer cannot be judged (another host sharing the filesystem, another container) counts as live: the message says
to remove it by hand once that run has ended. Only the files this tool writes are removed, and the folder only
when nothing else is left in it.

Each partial folder holds `writer.json` (host, pid, PID namespace, boot id, start time) from right after it is
created; of two runs that start together and see each other, the later start refuses.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

from pydantic import Field, ValidationError

from core.config.errors import DataError
from core.config.file_shape import read_small_file
from core.data.partial_outputs import RaisingStopSignals, Writer, this_writer, writer_is_gone

WRITER_FILE = "writer.json"


class WriterRecord(Writer):
    """writer.json: the process writing a partial folder (every field recorded; null: unreadable), and since
    when."""

    host: str
    pidns: Optional[str]
    boot: Optional[str]
    since_ns: Annotated[int, Field(ge=0)]


def this_record() -> WriterRecord:
    return WriterRecord(**this_writer().model_dump(), since_ns=time.time_ns())


class PartialFolder:
    """with PartialFolder(out, files, "--out", say) as folder: write `files` into folder.path, then
    folder.publish(). Leaving the block without publishing (an error, Ctrl-C, SIGTERM or SIGHUP: `Stopped`)
    removes them. `say` gets the notes about leftovers removed."""

    def __init__(self, out: Path, files: tuple[str, ...], option: str, say: Callable[[str], None]):
        self.out, self.files, self.option, self.say = out, files, option, say
        self.me = this_record()
        self.path = out.with_name(f"{out.name}.partial-{self.me.pid}")
        self.created = self.published = False

    def __enter__(self) -> PartialFolder:
        if self.out.exists() or self.out.is_symlink():
            raise DataError(f"{self.option} {self.out} exists: give a new folder (nothing was written)")
        self._refuse_live_writers(())  # before creating anything
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.signals = RaisingStopSignals()
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> None:
        try:
            self.path.mkdir()
        except FileExistsError:
            raise DataError(
                f"{self.option} {self.out}: {self.path} exists and was not written by a run of this tool: move it away"
            ) from None
        self.created = True
        self.me = self.me.model_copy(update={"since_ns": time.time_ns()})  # the start is when others can see it
        (self.path / WRITER_FILE).write_text(self.me.model_dump_json())
        self._refuse_live_writers((self.me.since_ns, self.me.host, self.me.pid))

    def publish(self) -> None:
        """Rename the complete folder to `out` (refused if `out` appeared meanwhile: the partial folder goes)."""
        self.signals.hold()  # a stop signal now waits for the rename, then goes where it would have gone
        (self.path / WRITER_FILE).unlink()
        try:
            if self.out.exists() or self.out.is_symlink():
                raise FileExistsError(self.out)
            os.rename(self.path, self.out)  # fails on a non-empty folder: another run's output is never replaced
        except OSError:
            raise DataError(
                f"{self.option} {self.out} appeared while this run wrote it (another run?): it was left "
                "as it is and this run's output removed"
            ) from None
        self.published = True

    def __exit__(self, *error) -> None:
        self.signals.hold()
        if self.created and not self.published:
            remove_partial(self.path, self.files)
        self.signals.restore()

    def _refuse_live_writers(self, mine: tuple) -> None:
        """Remove the partial folders of writers that are gone; refuse if a live one (or one that cannot be
        judged) is writing `out`: any, before this run created its folder, or one that started earlier after."""
        for folder, writer in self._peers():
            if self._is_predecessor(writer) or writer_is_gone(writer, self.me):
                whole = remove_partial(folder, self.files)
                self.say(
                    f"removed {folder if whole else 'what this tool wrote in ' + str(folder)}: the partial "
                    f"output of a run (pid {writer.pid} on {writer.host}) that ended before completing it"
                    + ("" if whole else "; the other files there were left as they are")
                )
            elif not mine or (writer.since_ns, writer.host, writer.pid) < mine:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(writer.since_ns / 1e9))
                judged = (
                    ""
                    if writer.host == self.me.host and writer.pidns == self.me.pidns
                    else f" (if that run has ended, remove {folder})"
                )
                raise DataError(
                    f"{self.option} {self.out}: another run is writing it (pid {writer.pid} on "
                    f"{writer.host}, since {started}, into {folder}){judged}; wait for it, or give "
                    "another folder"
                )

    def _is_predecessor(self, writer: WriterRecord) -> bool:
        """A record of this process's pid that is not this run's: an ended run that had the same pid."""
        return (writer.host, writer.pidns, writer.boot, writer.pid) == (
            self.me.host,
            self.me.pidns,
            self.me.boot,
            self.me.pid,
        )

    def _peers(self) -> list[tuple[Path, WriterRecord]]:
        """The other partial folders of `out` that hold a writer record (anything else is not this tool's)."""
        found = []
        for name in sorted(glob.glob(glob.escape(str(self.out)) + ".partial-*")):
            folder = Path(name)
            if (folder == self.path and self.created) or folder.is_symlink() or not folder.is_dir():
                continue
            try:
                found.append((folder, WriterRecord.model_validate_json(read_small_file(folder / WRITER_FILE, 4096))))
            except (OSError, ValueError, ValidationError):  # no record (yet), or not one: not judged, not touched
                continue
        return found


def remove_partial(folder: Path, files: tuple[str, ...]) -> bool:
    """Remove the files this tool writes into a partial folder, then the folder if nothing else is in it (True)."""
    for name in (*files, WRITER_FILE):
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            pass
    try:
        folder.rmdir()
    except OSError:  # something else is in it: not ours to delete
        return False
    return True
