"""A stand-in for the three names of Hugging Face ``datasets`` that torchtitan 0.2.2's text
loader uses (``Dataset``, ``load_dataset``, ``datasets.distributed.split_dataset_by_node``).

Only for ``benchmarks/torchtitan/torchtitan_h200.sh``: the H200 image has no ``datasets``, and its wheels
with their dependencies (pyarrow alone is about 40 MB) do not fit in what a run can carry.
The script puts this folder on the path only when ``import datasets`` fails. It reads a local
folder of JSON-lines files (``{"text": ...}`` per line), as ``load_dataset(DIR, split="train")``
would for torchtitan's ``c4_test``, into a map-style dataset, so torchtitan's own loader
(tokenize, pack, ``skip`` to the checkpointed sample index on resume) runs unchanged.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

__version__ = "0.0-adahop-shim"


class Dataset:
    """A list of rows (dicts) with the few ``datasets.Dataset`` methods torchtitan calls."""

    def __init__(self, rows: list[dict]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict:
        return self._rows[i]

    def __iter__(self):
        return iter(self._rows)

    def skip(self, n: int) -> Dataset:
        return Dataset(self._rows[n:])

    def shard(self, num_shards: int, index: int, contiguous: bool = True) -> Dataset:
        per, extra = divmod(len(self._rows), num_shards)
        start = index * per + min(index, extra)
        return Dataset(self._rows[start : start + per + (index < extra)])


def _read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_dataset(path: str, name: str | None = None, split: str | None = None, **kwargs) -> Dataset:
    """The rows of a JSON-lines file, or of every ``*.json``/``*.jsonl``(``.gz``) file of a folder."""
    if kwargs.get("streaming"):
        raise NotImplementedError("the datasets stand-in reads local files only (no streaming)")
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if ".json" in f.name)
    if not files:
        raise FileNotFoundError(f"no .json/.jsonl files in {path}")
    return Dataset([row for f in files for row in _read(f)])
