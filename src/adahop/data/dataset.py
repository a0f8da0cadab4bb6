"""Tokenized data: a source's documents as one memory-mapped token array, split in two.

The documents are tokenized once, each followed by the end-of-document token, into a flat
``uint16`` (``uint32`` for vocabularies above 65536) file next to a small JSON index; both are
cached under a key of the source and the tokenizer. The split is a pure function of that
array: validation is the last ``val_fraction`` of the tokens, moved back to the nearest
document start within one validation length so that held-out documents are whole (a source
that is one long document is cut mid-document). Sources keep their document order, so the
tail is a sample of the whole only if that order is random: the embedded corpus is in hash
order, and shuffled dumps such as C4 or FineWeb are too.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..atomic import atomic_file, remove_stale_temp_files, write_atomic
from .cache import cache_dir, content_key
from .corpus import stdlib_source
from .sources import TextSource, parse_data_spec
from .tokenizer import DEFAULT_VOCAB_SIZE, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

EMBEDDED_SOURCE = "stdlib"  # the --data value (and default) for the embedded corpus
DEFAULT_VAL_FRACTION = 0.02
ENCODE_BATCH_BYTES = 2**20  # text handed to the (multi-threaded) encoder at once
CACHE_FORMAT = 1


@dataclass
class TokenData:
    tokenizer: Tokenizer
    train: np.ndarray  # memory-mapped token ids
    val: np.ndarray
    source: str  # human-readable name of the source


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _batches(documents: Iterable[str], max_bytes: int) -> Iterator[list[str]]:
    batch, n_bytes = [], 0
    for doc in documents:
        batch.append(doc)
        n_bytes += len(doc)
        if n_bytes >= max_bytes:
            yield batch
            batch, n_bytes = [], 0
    if batch:
        yield batch


def _write_tokens(source: TextSource, tokenizer: Tokenizer, path: Path, progress: bool) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    n_tokens = n_docs = 0
    bar = tqdm(
        total=source.size_hint(),
        unit="B",
        unit_scale=True,
        desc=f"tokenizing {source.name}",
        disable=not progress,
    )
    with bar, atomic_file(path) as f:
        for batch in _batches(source.documents(), ENCODE_BATCH_BYTES):
            ids = [token for doc in tokenizer.encode_batch(batch) for token in (*doc, tokenizer.eos_id)]
            f.write(np.asarray(ids, dtype=dtype).tobytes())
            n_tokens += len(ids)
            n_docs += len(batch)
            bar.update(sum(len(doc.encode()) for doc in batch))
    if n_tokens == 0:
        path.unlink()
        raise ValueError(f"{source.name} contains no text")
    return {
        "format": CACHE_FORMAT,
        "dtype": dtype.name,
        "num_tokens": n_tokens,
        "num_documents": n_docs,
        "source": source.name,
    }


def load_tokens(
    source: TextSource,
    tokenizer: Tokenizer,
    cache: str | os.PathLike | None = None,
    progress: bool = True,
) -> np.memmap:
    """``source`` tokenized by ``tokenizer`` as a read-only memory map, from the cache if there."""
    key = content_key("tokens", CACHE_FORMAT, source.fingerprint(), tokenizer.fingerprint())
    directory = cache_dir(cache) / "tokens"
    bin_path, index_path = directory / f"{key}.bin", directory / f"{key}.json"
    index = _cached_index(bin_path, index_path)
    if index is None:  # the index is written last: it marks a complete entry
        remove_stale_temp_files(directory)
        index = _write_tokens(source, tokenizer, bin_path, progress)
        write_atomic(index_path, json.dumps(index, indent=1))
    return np.memmap(bin_path, dtype=index["dtype"], mode="r", shape=(index["num_tokens"],))


def _cached_index(bin_path: Path, index_path: Path) -> dict | None:
    """The index of a complete, intact cache entry; None when there is none (a damaged entry,
    edited or cut short outside adahop, is reported and rebuilt)."""
    if not index_path.exists():
        return None
    try:
        index = json.loads(index_path.read_text())
        expected = index["num_tokens"] * np.dtype(index["dtype"]).itemsize
        found = bin_path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"unreadable ({type(e).__name__}: {e})"
    else:
        if found == expected:
            return index
        problem = f"{bin_path.name} has {found} bytes, its index says {expected}"
    log.warning("warning: token cache entry %s is damaged (%s); rebuilding it", index_path.with_suffix(""), problem)
    return None


def split_point(tokens: np.ndarray, eos_id: int, val_fraction: float) -> int:
    """Index where the validation tokens start (see the module docstring)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(len(tokens) * val_fraction))
    cut = len(tokens) - n_val
    lo = max(1, cut - n_val)
    doc_ends = np.flatnonzero(np.asarray(tokens[lo - 1 : cut]) == eos_id)
    return lo + int(doc_ends[-1]) if len(doc_ends) else cut


def resolve_source(data: str | TextSource | None) -> TextSource:
    """A ``--data`` value (None or ``"stdlib"``: the embedded corpus) as a source."""
    if isinstance(data, TextSource):
        return data
    if data is None or data == EMBEDDED_SOURCE:
        return stdlib_source()
    return parse_data_spec(data)


def prepare_data(
    data: str | TextSource | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache: str | os.PathLike | None = None,
    progress: bool = True,
) -> TokenData:
    """Everything the trainer needs from ``--data``: tokenizer and train/validation tokens,
    each built on first use and cached under ``cache`` (default ``$ADAHOP_CACHE`` or
    ``~/.cache/adahop``)."""
    source = resolve_source(data)
    tokenizer = load_tokenizer(source, vocab_size, cache, show_progress=progress)
    tokens = load_tokens(source, tokenizer, cache, progress)
    start = split_point(tokens, tokenizer.eos_id, val_fraction)
    return TokenData(tokenizer, train=tokens[:start], val=tokens[start:], source=source.name)
