"""One run at a time in a run directory: ``adahop train`` holds an exclusive ``flock`` on
``<run_dir>/.lock`` for the whole run (rank 0 for all ranks), and a second run on the same
``--out`` refuses in one line naming the first one's process and host.

The kernel releases the lock when the process holding it exits, however it exits (SIGKILL, a
crash, a lost node's NFS lease), so a lock left by a dead run never blocks the next one. The
file stays (deleting it would let a third run lock a new file while the second holds the old);
its text names the last holder, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirectoryInUseError(RuntimeError):
    """Another process is training in this run directory."""


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock for the block (creating the directory); raise
    ``RunDirectoryInUseError`` when another process holds it. A directory that cannot be
    created or written is left to the trainer's own one-line refusal."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said which"
            raise RunDirectoryInUseError(
                f"--out {run_dir} is in use by another run ({holder}); "
                "wait for it to finish, stop it, or pass another --out DIR"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
