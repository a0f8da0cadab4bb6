"""The on-disk cache for derived data (tokenizers, tokenized corpora).

Entries are named by a hash of everything they were derived from, so a changed source or
setting gets a new entry instead of a stale one, and they are written atomically (temporary
file, then ``os.replace``) so an interrupted run never leaves a half-written entry behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CACHE_ENV = "ADAHOP_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/adahop"
KEY_HEX_CHARS = 16


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """``override``, else ``$ADAHOP_CACHE``, else ``~/.cache/adahop``."""
    path = override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(path).expanduser()


def content_key(*parts: object) -> str:
    """A short stable hash of JSON-serializable ``parts``."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:KEY_HEX_CHARS]


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Open a temporary sibling of ``path`` for binary writing; rename it onto ``path`` only
    if the block finishes, delete it otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
