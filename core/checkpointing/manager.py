"""The Checkpointer: everything the training loop does with checkpoints, in three calls after it is opened.

    checkpointer = open_checkpointer(cfg.checkpoint, rank, device, config=cfg)  # before any work: the path's
                                        # lock; where to resume from; a resume that changes the result refused
    checkpointer.restore(parts, state, last_step, saves_at)  # the newest usable checkpoint into the parts (or
                                        # None); a step folder the run would save over but may not replace refused
    checkpointer.maybe_save(step, metrics, save, sync)  # every step: completes a finished async save, checks
                                        # checkpoint.monitor; when `save`, step_<N>/ (COMPLETE once every rank is
                                        # done); at the run's last step, waits for the save in flight
    checkpointer.close()                # the lock released (an async save in flight after an error is abandoned)

`parts` maps the checkpoint's top-level keys to stateful parts (core/checkpointing/parts.py: `training_parts`);
the Checkpointer never reaches into them. Methods are collectives (call them on every rank) unless noted.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig

from core.checkpointing.changes import config_changes
from core.checkpointing.layout import (
    DCP_ERRORS,
    CheckpointError,
    check_checksums,
    complete_checkpoints,
    describe,
    is_complete,
    is_own,
    is_own_incomplete,
    read_marker,
    resolve_checkpoint,
    set_aside_dirs,
    set_aside_name,
    start_marker,
    step_dirs,
    step_of,
    verify,
    write_marker,
)
from core.checkpointing.lock import LockHeld, PathLock
from core.checkpointing.parts import CheckpointPart, Saved
from core.checkpointing.retention import checkpoints_to_keep, set_aside_to_delete
from core.checkpointing.staging import AlreadyStaged, HostStager
from core.checkpointing.storage import ChecksummingWriter, SafeLoadPlanner, SafeReader
from core.config.errors import ConfigError
from core.config.schema import CheckpointConfig
from core.config.validation import save_config
from core.training.state import TrainState

log = logging.getLogger("checkpoint")


@dataclass
class PendingSave:
    """An async save whose files are still being written; completed by `wait`."""

    future: Future
    target: Path
    step: int
    metrics: dict
    started: float  # perf_counter() when the save began


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        rank: int,
        device: torch.device,
        config: Optional[DictConfig] = None,
        config_name: Optional[str] = None,
    ):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.is_main = rank == 0
        self.config = config  # the run's resolved config, saved beside each checkpoint
        # The name of the config it was composed from (--config-name), in each COMPLETE marker: predict.py and
        # generate.py given a step folder and no --config-name compose it again.
        self.config_name = config_name
        self.path = Path(cfg.path)
        self.candidates: list[Path] = []  # checkpoints to try, newest first (prepare)
        self.auto = False  # resume=auto|true: a corrupt newest checkpoint falls back to the one before
        self.pending: Optional[PendingSave] = None
        self.protected: set[int] = set()  # steps retention must keep (the one resumed from)
        self.resumed_from: Optional[Path] = None  # kept by retention too, also when it is a set-aside folder
        self.parts: Mapping[str, CheckpointPart] = {}  # what every save writes (given to `restore`)
        self.last_step = 0  # the run's last step: its save is waited for (given to `restore`)
        self._async_group = None
        self._stager = HostStager()
        self._lock = PathLock(self.path)
        self._locked = False

    # ---- where to resume from

    def _prepare(self) -> None:
        """Before any work (a collective): take the path's lock (which also proves it writable), then
        decide which checkpoints `restore` tries, newest first: an explicit folder must be complete;
        resume=false refuses existing checkpoints unless overwrite=true, which deletes them. A resumed run
        whose result-changing settings differ from the checkpoint's stops here (core/checkpointing/changes.py)."""
        self._take_lock()
        resume = self.cfg.resume
        mode = resume.lower() if isinstance(resume, str) else resume
        existing = step_dirs(self.path)
        foreign = [p.name for p in existing if not is_own(p)]
        if foreign and self.is_main:
            log.warning(
                "leaving alone step folders under %s that this tool did not write (or that hold other files): %s",
                self.path,
                ", ".join(foreign),
            )
        if mode in (False, "false", "no", "none", ""):
            own = [p for p in existing if is_own(p)]
            if own and not self.cfg.overwrite:
                raise ConfigError(
                    f"checkpoint.path={self.path} already holds checkpoints ({own[-1].name}, ...) and "
                    "checkpoint.resume=false: set checkpoint.overwrite=true to delete them, or use another path"
                )
            dist.barrier()  # every rank has looked before rank 0 deletes
            if own and self.is_main:
                log.warning("checkpoint.overwrite=true: deleting %d checkpoints under %s", len(own), self.path)
                for p in own:
                    shutil.rmtree(p)
            self.candidates = []
        elif mode in (True, "auto", "true"):
            self.auto = True
            complete = complete_checkpoints(self.path)
            partial = [p.name for p in existing if is_own_incomplete(p)]
            if partial and self.is_main:
                log.warning(
                    "ignoring incomplete checkpoints (interrupted saves) under %s: %s", self.path, ", ".join(partial)
                )
            if not complete and mode in (True, "true"):
                raise ConfigError(f"checkpoint.resume=true but {self.path} holds no complete checkpoint")
            self.candidates = complete[::-1]
        else:
            chosen = resolve_checkpoint(resume)  # a step folder, or a root (or <root>/last): its newest
            verify(chosen)  # an explicit choice never falls back: missing or incomplete is an error
            self.candidates = [chosen]
        if self.candidates:
            self._check_config_changes(self.candidates[0])

    def _check_save_targets(self, first_step: int, last_step: int, saves_at: Callable[[int], bool]) -> None:
        """Before any training (a collective): a step folder this run will save (steps first_step..last_step for which
        `saves_at` is true) that exists and is not a checkpoint this tool may replace stops the run now, not when the
        run gets there. (A save on a signal is refused at that moment.)"""
        error = [None]
        if self.is_main:
            named = [self.path / name for name in (os.listdir(self.path) if self.path.is_dir() else [])]
            blocked = sorted(
                (
                    p
                    for p in named  # a file or a link named step_<N> blocks a save too
                    if first_step <= (step_of(p) or -1) <= last_step
                    and saves_at(step_of(p))
                    and not (p.is_dir() and not p.is_symlink() and is_own(p))
                ),
                key=step_of,
            )
            if blocked:
                error = [
                    f"this run saves step {step_of(blocked[0])}, but {blocked[0]} exists and is not a checkpoint "
                    "this tool wrote (or its COMPLETE marker is damaged), so it will not replace it: move it "
                    "away, or use another checkpoint.path"
                ]
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise ConfigError(error[0])

    def _take_lock(self) -> None:
        error = None
        if self.is_main:
            try:
                self._lock.acquire()
                self._locked = True
            except LockHeld as e:
                error = f"checkpoint.path: {e}"
            except OSError as e:
                error = f"checkpoint.path={self.path} is not writable ({type(e).__name__}: {e})"
        message = [error]
        dist.broadcast_object_list(message, src=0)
        if message[0]:
            raise ConfigError(message[0])

    def _check_config_changes(self, path: Path) -> None:
        if self.config is None or not (path / "config.yaml").is_file():
            return
        refused, other = config_changes(path / "config.yaml", self.config)
        if refused and not self.cfg.allow_config_changes:
            raise ConfigError(
                f"resuming from {path}, but these settings differ from the ones it was trained with:\n  "
                + "\n  ".join(refused)
                + "\nThey change the run's result, so a resume keeps them. To start a new run "
                "with them, give it a folder of its own: checkpoint.path=<a new folder> (add checkpoint.init_from="
                + str(path)
                + " to start from these weights); to continue this run with them on purpose, set "
                "checkpoint.allow_config_changes=true"
            )
        if self.is_main and (refused or other):
            log.warning(
                "resuming from %s with changed settings (in effect from the first resumed step): %s",
                path,
                "; ".join(refused + other),
            )

    def close(self) -> None:
        """Release the path's lock (rank 0). Not a collective; an async save in flight is left incomplete."""
        if self._locked:
            self._lock.release()
            self._locked = False

    # ---- loading

    def restore(
        self, parts: Mapping[str, CheckpointPart], state: TrainState, last_step: int, saves_at: Callable[[int], bool]
    ) -> Optional[Path]:
        """Load the newest usable checkpoint into `parts` (which every later save writes; `state` is the loop's
        counters, among them); its path, or None to start fresh. Automatic resume skips a corrupt checkpoint with
        a warning and uses the one before it. Then a step folder this run will save (the steps after `state.step`
        up to `last_step` for which `saves_at` is true) that it may not replace stops the run, before any training."""
        self.parts, self.last_step = parts, last_step
        path = self._load_newest(parts)
        self._check_save_targets(state.step + 1, last_step, saves_at)
        return path

    def _load_newest(self, parts: Mapping[str, CheckpointPart]) -> Optional[Path]:
        for i, path in enumerate(self.candidates):
            try:
                if i > 0:  # _prepare compared the newest; the one a fallback loads instead is compared here
                    self._check_config_changes(path)
                self._load(path, parts)
            except CheckpointError as e:
                if not self.auto or i == len(self.candidates) - 1:
                    raise
                log.warning("cannot resume from %s: %s; trying the previous checkpoint", path, e)
                continue
            self.protected.add(step_of(path) or -1)
            self.resumed_from = path
            self._set_aside_newer(read_marker(path)["step"])
            return path
        return None

    def _set_aside_newer(self, step: int) -> None:
        """A collective, after resuming from `step`: this tool's complete checkpoints under checkpoint.path of later
        steps (a branch the run went back from, or damaged ones automatic resume skipped) are renamed
        step_<N>.superseded: never resumed from, ranked by retention or saved over, and kept until retention
        drops them (`_apply_retention`). Interrupted saves stay as they are: the next save deletes them."""
        if self.is_main:
            for p in step_dirs(self.path):
                if (step_of(p) or -1) > step and is_own(p) and not is_own_incomplete(p):
                    kept = set_aside_name(p)
                    p.rename(kept)
                    log.warning(
                        "%s is newer than the checkpoint this run continues from (step %d): kept as %s",
                        p,
                        step,
                        kept.name,
                    )
        dist.barrier()

    def _load(self, path: Path, parts: Mapping[str, CheckpointPart]) -> None:
        start = time.perf_counter()
        metadata = verify(path)
        if self.cfg.verify_checksums:
            check_checksums(path)
        targets = {key: part.load_target(Saved(path, metadata, key)) for key, part in parts.items()}
        state = {key: target for key, target in targets.items() if target is not None}
        try:
            dcp.load(state, storage_reader=SafeReader(str(path), metadata), planner=SafeLoadPlanner())
        except DCP_ERRORS as e:
            raise CheckpointError(f"{path}: loading failed ({describe(e)})") from None
        for key, loaded in state.items():
            try:
                parts[key].load_state_dict(loaded)
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:  # values that do not fit the part
                raise CheckpointError(f"{path}: its {key} state cannot be taken ({type(e).__name__}: {e})") from None
        if self.is_main:
            log.info("resumed from %s in %.1f s", path, time.perf_counter() - start)

    # ---- saving

    def maybe_save(
        self, step: int, metrics: dict[str, dict[str, float]], save: bool, sync: bool = False
    ) -> Optional[float]:
        """After every optimizer step: complete an async save whose writes are done; check checkpoint.monitor
        against the step's metrics ({"train": {...}, "val": {...}}, either empty when the step has none); when
        `save`, save step_<step> with them as train/<name> and val/<name> (synchronously when `sync`: the run
        stops) and return the seconds the loop was held up (None: no save). At the run's last step, wait
        for the save in flight."""
        flat = {f"{split}/{name}": value for split, values in metrics.items() for name, value in values.items()}
        self._check_monitor(flat)
        self._poll()
        stall = self._save(step, self.parts, flat, force_sync=sync) if save else None
        if step >= self.last_step:
            self._wait()
        return stall

    def _save(self, step: int, parts: Mapping[str, CheckpointPart], metrics: dict, force_sync: bool = False) -> float:
        """Save step_<step>; return the seconds the training loop was held up."""
        start = time.perf_counter()
        self._wait()  # at most one save in flight
        target = self.path / f"step_{step}"
        error = [None]
        if self.is_main:
            try:
                if target.exists() and not is_own(target):
                    raise CheckpointError(
                        f"{target} exists and is not a checkpoint this tool wrote: move it away "
                        "(the checkpoints before it are kept)"
                    )
                if target.exists() and is_complete(target):
                    # A save of this step before that this run did not continue from (usually set aside at
                    # resume already): kept beside, never lost.
                    kept = set_aside_name(target)
                    target.rename(kept)
                    log.warning(
                        "%s exists (this run resumed from an earlier step): kept as %s, saving anew", target, kept.name
                    )
                elif target.exists():  # an interrupted save of this tool
                    shutil.rmtree(target)
                start_marker(target)
            except (CheckpointError, OSError) as e:
                error = [f"saving {target} failed ({type(e).__name__}: {e})" if isinstance(e, OSError) else str(e)]
        dist.broadcast_object_list(error, src=0)  # every rank fails together
        if error[0]:
            raise CheckpointError(error[0])
        state = {key: part.state_dict() for key, part in parts.items()}
        state = {key: value for key, value in state.items() if value}
        writer = ChecksummingWriter(str(target), thread_count=self.cfg.write_threads)
        if self.cfg.async_save and not force_sync:
            if self._async_group is None:  # its own group: the writer thread's collectives stay off the loop's
                self._async_group = dist.new_group(backend="gloo")
            # We copy to host memory ourselves (core/checkpointing/staging.py) and hand DCP the copy as staged.
            future = dcp.async_save(
                self._stager.stage(state),
                storage_writer=writer,
                process_group=self._async_group,
                async_stager=AlreadyStaged(),
            )
            self.pending = PendingSave(future, target, step, metrics, start)
        else:
            try:
                dcp.save(state, storage_writer=writer)
            except DCP_ERRORS as e:  # disk full, permissions: fail loudly, keep the older checkpoints
                raise CheckpointError(f"saving {target} failed ({describe(e)})") from None
            dist.barrier()  # every rank's files are on disk before the marker says so
            self._finish(PendingSave(None, target, step, metrics, start))
        return time.perf_counter() - start

    def _poll(self) -> None:
        """Complete an async save if its writes are done (not a collective; cheap)."""
        if self.pending is not None and self.pending.future.done():
            self._wait()

    def _wait(self) -> None:
        """Block until the save in flight (if any) is written, and complete it."""
        if self.pending is None:
            return
        save, self.pending = self.pending, None
        try:
            save.future.result()
        except DCP_ERRORS as e:
            raise CheckpointError(f"saving {save.target} failed ({describe(e)})") from None
        # On rank 0 the future ends after DCP wrote .metadata, which it does only once every rank has
        # reported its writes done: rank 0 may write the marker now.
        self._finish(save)

    def _finish(self, save: PendingSave) -> None:
        if not self.is_main:
            return
        named = {"config_name": self.config_name} if self.config_name else {}
        try:  # a disk that fills (or turns read-only) after the shards: one line naming the folder, as for a shard
            if self.config is not None:
                save_config(self.config, save.target / "config.yaml")
            write_marker(save.target, {"step": save.step, "metrics": save.metrics, "saved_at": time.time(), **named})
        except OSError as e:  # without COMPLETE the folder is an interrupted save: never resumed from
            raise CheckpointError(f"saving {save.target} failed ({type(e).__name__}: {e})") from None
        size = sum(p.stat().st_size for p in save.target.iterdir() if p.is_file())
        log.info(
            "saved checkpoint %s (%.1f MB in %.2f s%s)",
            save.target,
            size / 2**20,
            time.perf_counter() - save.started,
            ", async" if self.cfg.async_save else "",
        )
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Rank 0, after a checkpoint completed: drop interrupted saves, what the keep_* rules release, and the
        set-aside folders that are no longer needed."""
        in_flight = self.pending.target if self.pending is not None else None
        entries, folders = [], {}
        for p in step_dirs(self.path):
            if p == in_flight:
                continue
            if not is_complete(p):
                if is_own_incomplete(p):
                    log.info("deleting incomplete checkpoint %s", p)
                    shutil.rmtree(p, ignore_errors=True)
                continue
            if not is_own(p):  # e.g. a malformed COMPLETE: never deleted, never ranked
                log.warning("retention leaves %s alone: it is not a checkpoint this tool can read as its own", p)
                continue
            value = read_marker(p).get("metrics", {}).get(self.cfg.monitor) if self.cfg.monitor else None
            entries.append((step_of(p), value))
            folders[step_of(p)] = p
        keep = checkpoints_to_keep(
            entries,
            self.cfg.keep_last_n,
            self.cfg.keep_every_n_steps,
            self.cfg.keep_best_k,
            self.cfg.monitor_mode,
            self.protected,
        )
        for step, _ in entries:
            if step not in keep:  # the folder examined above, never a name made up from its step
                log.info("deleting checkpoint %s (retention)", folders[step].name)
                shutil.rmtree(folders[step], ignore_errors=True)
        if entries:
            self._drop_set_aside(max(step for step, _ in entries))

    def _drop_set_aside(self, newest_complete: int) -> None:
        """Rank 0: delete this tool's step_<N>.superseded folders that retention releases (retention.py:
        set_aside_to_delete); a folder that is not this tool's (other files in it, a damaged marker) or the
        one this run resumed from is left alone."""
        resumed = self.resumed_from.resolve() if self.resumed_from is not None else None
        own = [(step, p) for step, p in set_aside_dirs(self.path) if is_own(p) and p.resolve() != resumed]
        released = set_aside_to_delete(
            [(step, is_complete(p)) for step, p in own], newest_complete, self.cfg.keep_last_n
        )
        for _, p in (own[i] for i in released):
            log.info("deleting %s (%s)", p.name, "set aside" if is_complete(p) else "an interrupted save")
            shutil.rmtree(p, ignore_errors=True)

    def _check_monitor(self, metrics: dict) -> None:
        """checkpoint.monitor must name a metric the run records, train/<name> (loss, lr, grad_norm) or val/<name>;
        checked whenever metrics of its kind arrive (not a collective)."""
        monitor = self.cfg.monitor
        if not monitor:
            return
        kind = monitor.split("/")[0] + "/"
        same_kind = sorted(k for k in metrics if k.startswith(kind))
        if same_kind and monitor not in metrics:
            raise ConfigError(
                f"checkpoint.monitor={monitor!r} is not a metric of this run; there are: {', '.join(same_kind)}"
            )


def open_checkpointer(
    cfg: CheckpointConfig,
    rank: int,
    device: torch.device,
    config: Optional[DictConfig] = None,
    config_name: Optional[str] = None,
) -> Checkpointer:
    """A Checkpointer that holds checkpoint.path's lock and has decided where to resume from (a collective, before
    any work: Checkpointer._prepare); the lock is released again when that refuses the run."""
    checkpointer = Checkpointer(cfg, rank, device, config=config, config_name=config_name)
    try:
        checkpointer._prepare()
    except BaseException:
        checkpointer.close()
        raise
    return checkpointer
