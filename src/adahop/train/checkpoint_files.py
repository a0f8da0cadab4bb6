"""What both checkpoint formats share: names, listing, pruning, checksums, setting a damaged
checkpoint aside, and turning a failed write into one ``OSError``.

A run's checkpoints live in ``<run_dir>/checkpoints/``: ``step_XXXXXXX.pt`` files (one process,
``checkpoint``) and ``step_XXXXXXX/`` directories (several ranks, ``sharded_checkpoint``),
ordered by step. Each carries SHA-256 checksums of its bytes in ``sha256sum`` format (so
``sha256sum -c`` checks them too): a file in the sidecar ``step_XXXXXXX.pt.sha256``, a directory
in its own ``checksums.sha256``. A checkpoint whose bytes no longer match is unreadable: a
resumed run sets it aside (renamed to ``*.corrupt``, never deleted) and takes the one before.
A checkpoint written before checksums existed is read unverified.

Why two formats and not DCP for one process too (as torchtitan does): one ``torch.save`` file
resumes bit for bit and loads anywhere with ``torch.load(weights_only=True)``, with nothing to
gain from sharding; what the formats must agree on (this module, and ``checkpoint.newest_readable``
for the fallback) exists once.
"""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO

from ..atomic import write_atomic

CHECKPOINT_DIR = "checkpoints"
CHECKSUM_SUFFIX = ".sha256"  # a file checkpoint's sidecar: step_XXXXXXX.pt.sha256
CHECKSUM_FILE = "checksums.sha256"  # inside a directory checkpoint
CORRUPT_SUFFIX = ".corrupt"  # an unreadable checkpoint is renamed aside, never deleted
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # a file, or a sharded checkpoint's directory
_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not belong to this run."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint that cannot be read back as written: truncated, corrupt, changed or not a checkpoint."""


def is_checkpoint_name(name: str) -> bool:
    return _NAME.match(name) is not None


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where one process writes its step-``step`` checkpoint (several ranks: without ``.pt``)."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}.pt"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints (files and sharded directories), oldest first."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and p.is_dir() != bool(m[2])]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``run_dir/checkpoints``, or None."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints (with their checksums)."""
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
            _sidecar(path).unlink(missing_ok=True)


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint (and its checksums) to ``*.corrupt``; returns the new name."""
    aside = path.with_name(path.name + CORRUPT_SUFFIX)
    path.rename(aside)
    sidecar = _sidecar(path)
    if sidecar.exists():
        sidecar.rename(sidecar.with_name(sidecar.name + CORRUPT_SUFFIX))
    return aside


# ---- checksums ------------------------------------------------------------------------------
class HashingWriter:
    """A binary file's ``write`` that hashes what passes through it, so a checkpoint's checksum
    costs no second read."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _format(digests: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))


def write_file_checksum(path: Path, digest: str) -> None:
    """Record the checksum of the checkpoint file ``path`` in its sidecar."""
    write_atomic(_sidecar(path), _format({path.name: digest}))


def write_dir_checksums(directory: Path, digests: dict[str, str]) -> None:
    """Record the checksums of a checkpoint directory's files (names relative to it) inside it."""
    write_atomic(directory / CHECKSUM_FILE, _format(digests))


def verify_checksums(path: Path) -> None:
    """Raise ``UnreadableCheckpointError`` if a file of checkpoint ``path`` is missing or its bytes
    differ from the checksums written with it; a checkpoint without checksums passes."""
    manifest = path / CHECKSUM_FILE if path.is_dir() else _sidecar(path)
    base = path if path.is_dir() else path.parent
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as e:
        raise UnreadableCheckpointError(f"{path}: its checksums cannot be read ({e})") from None
    for line in text.splitlines():
        expected, _, name = line.partition("  ")
        file = base / name
        if not file.is_file():
            raise UnreadableCheckpointError(f"{path}: {name} is missing")
        actual = file_sha256(file)
        if actual != expected:
            raise UnreadableCheckpointError(
                f"{path}: {name} changed since it was written (sha256 {actual[:12]}..., recorded {expected[:12]}...)"
            )


# ---- failed writes --------------------------------------------------------------------------
def write_failure(error: BaseException, path: Path) -> OSError:
    """The ``OSError`` behind a failed checkpoint write, naming ``path``. ``torch.save``'s zip
    writer turns an ``OSError`` of its file (a full disk) into ``RuntimeError: [enforce fail at
    inline_container.cc ...] unexpected pos``, with the original as its ``__context__``; one that
    crossed ranks (DCP gathers failures by pickling) has lost it, and becomes an ``EIO`` that says
    how much space is left."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return OSError(seen.errno or errno.EIO, seen.strerror or str(seen), str(path))
        seen = seen.__cause__ or seen.__context__
    reason = f"{type(error).__name__}: {error}".splitlines()[0]
    return OSError(errno.EIO, f"the checkpoint writer failed ({reason}); {_free_space(path)}", str(path))


def _free_space(path: Path) -> str:
    directory = next((p for p in path.parents if p.is_dir()), Path("."))
    free = shutil.disk_usage(directory).free
    return f"{free / 2**20:,.1f} MiB free on its file system"
