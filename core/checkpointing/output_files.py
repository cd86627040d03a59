"""Weight files the checkpoint tools write: whole or not at all (a temporary file beside the target, created at a
random name that no other file or link holds, renamed into place), with the permissions the process's umask gives
any new file (0644 under umask 022), so that a model shared on a cluster can be read by the colleagues the user's
umask lets read it. (safetensors' own save_file keeps its temporary file's owner-only mode, 0600; torch.save alone
leaves a partial file when the process is killed.)"""

from __future__ import annotations

import os
import tempfile
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
    """`write(path)` writes the file at a temporary name beside `target`, which this creates first, at a random name
    and exclusively (mkstemp), so that no file or link planted beside the target is ever written or followed; the
    file is then given the umask's mode for new files and renamed to `target`. When `write` fails, the temporary file
    is removed and `target` is left as it was."""
    target = Path(target)
    descriptor, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.tmp-")
    os.close(descriptor)
    temporary = Path(name)
    try:
        write(temporary)
        # Opened again, not followed if a link: a writer may replace the file (safetensors renames its own onto it).
        descriptor = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(descriptor, 0o666 & ~umask())
        finally:
            os.close(descriptor)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_safetensors(tensors: dict[str, torch.Tensor], target: Path, metadata: Optional[dict[str, str]] = None) -> None:
    """`tensors` as a .safetensors file; a tensor sharing memory with an earlier one (a tied embedding and head read
    from a .bin) is written as a copy of its own, which safetensors requires."""
    from safetensors.torch import save_file

    storages: set[int] = set()
    unshared = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.clone() if pointer in storages else tensor
        if tensor.numel():
            storages.add(pointer)
    write_atomically(target, lambda path: save_file(unshared, str(path), metadata=metadata))


def save_torch(obj: object, target: Path) -> None:
    write_atomically(target, lambda path: torch.save(obj, path))
