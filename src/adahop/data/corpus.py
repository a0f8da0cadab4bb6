"""The embedded default corpus: the running interpreter's standard library sources.

It exists on every machine that runs Python, so training works with no download anywhere:
real code and prose (docstrings, comments), about 12 MB of ``.py`` for CPython 3.11 without
its test suites. ``STDLIB_MAX_BYTES`` bounds the tokenization time on larger installations.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from .sources import FileSource

STDLIB_MAX_BYTES = 16 * 2**20
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _path_hash(relative: Path) -> str:
    return hashlib.sha256(relative.as_posix().encode()).hexdigest()


def stdlib_files(max_bytes: int = STDLIB_MAX_BYTES) -> list[Path]:
    """The stdlib ``.py`` files outside test and third-party directories, ordered by a hash of
    their relative path; a file that would take the total past ``max_bytes`` is left out.

    Hash order rather than alphabetical order makes a capped selection (a small test subset)
    and the held-out tail (see :mod:`adahop.data.dataset`) a sample of the whole library
    instead of one alphabetical corner of it.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune, do not descend
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files.sort(key=lambda p: _path_hash(p.relative_to(root)))
    selected, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size <= max_bytes:
            selected.append(path)
            total += size
    return selected


def stdlib_source(max_bytes: int = STDLIB_MAX_BYTES) -> FileSource:
    """The embedded corpus as a text source."""
    files = stdlib_files(max_bytes)
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return FileSource(files, name=f"stdlib (Python {version}, {len(files)} files, {size_mb:.1f} MB)")
