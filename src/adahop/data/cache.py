"""The on-disk cache for derived data (tokenizers, tokenized corpora).

Entries are named by a hash of everything they were derived from, so a changed source or
setting gets a new entry instead of a stale one, and they are written atomically (temporary
file, then ``os.replace``) so an interrupted run never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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
