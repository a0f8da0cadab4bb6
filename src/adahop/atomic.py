"""Atomic file writes: a crash mid-write never leaves a half-written checkpoint, plan or cache.

The data goes to a temporary sibling, is flushed and fsynced, then renamed over the target (an
atomic step on POSIX), and the directory is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


_TEMP_NAME = re.compile(r"^\..+\.tmp(\d+)$")  # what atomic_file names its temporary files


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a temporary sibling of ``path`` for binary writing; it replaces ``path`` only if the
    block finishes, and is deleted otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # matches _TEMP_NAME
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` (text is written as UTF-8) atomically."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def publish_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move the finished directory ``tmp`` to ``path`` (a sibling) by renaming it; an existing
    ``path`` is first renamed aside to ``.NAME.old`` and deleted after, so at every moment
    ``path`` is either absent, the old directory or the new one, never a partial one."""
    tmp, path = Path(tmp), Path(path)
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_figure(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> None:
    """``fig.savefig`` (matplotlib) atomically, in the format of ``path``'s suffix."""
    with atomic_file(path) as f:
        fig.savefig(f, format=Path(path).suffix.lstrip("."), **savefig_kwargs)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # a write of this process may be under way
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that writers killed mid-write (SIGKILL, power loss) left in
    ``directory``; those of processes still running are kept. Returns the deleted paths."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [
        p
        for p in sorted(directory.iterdir())
        if (m := _TEMP_NAME.match(p.name)) and p.is_file() and not _process_alive(int(m[1]))
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
