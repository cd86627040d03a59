"""Weight files the checkpoint tools write: whole or not at all (a temporary file beside the target, renamed into
place), with the permissions the process's umask gives any new file (0644 under umask 022), so that a model shared
on a cluster can be read by the colleagues the user's umask lets read it. (safetensors' own save_file keeps its
temporary file's owner-only mode, 0600; torch.save alone leaves a partial file when the process is killed.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch


def umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc/self/status), else set and restored."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """`write(path)` writes the file at a temporary name beside `target`; it is then given the umask's mode for new
    files and renamed to `target`. Nothing is left at either name when `write` fails."""
    target = Path(target)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.chmod(temporary, 0o666 & ~umask())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_safetensors(tensors: dict[str, torch.Tensor], target: Path, metadata: Optional[dict[str, str]] = None) -> None:
    from safetensors.torch import save_file

    write_atomically(target, lambda path: save_file(tensors, str(path), metadata=metadata))


def save_torch(obj: object, target: Path) -> None:
    write_atomically(target, lambda path: torch.save(obj, path))
