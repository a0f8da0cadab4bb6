"""Text sources: where documents come from (local files, or Hugging Face ``datasets``).

A source yields documents (strings) in a fixed order and has a fingerprint that changes when
its content may have, which keys the tokenizer and token caches. ``parse_data_spec`` turns a
``--data`` value into a source:

- a ``.txt`` / ``.py`` file (one document per file), a ``.jsonl`` file (one document per line,
  field ``text``), a ``.parquet`` file (one document per row, column ``text``); the first three
  may be gzip-compressed (``.txt.gz``, ``.py.gz``, ``.jsonl.gz``: read as they decompress);
- a directory (every supported file below it) or a glob (``data/*.jsonl``), in sorted order;
- ``hf:NAME[:CONFIG]``: the ``train`` split of a Hugging Face dataset, streamed (nothing is
  downloaded beyond what is read) and capped at ``max_bytes`` of text.

Text must be UTF-8: a file that is not (Latin-1, binary) is an error naming the file and the
line, never silently decoded with replacement characters, and so is a NUL byte (a binary file
that happens to decode). A ``text`` field or column must hold strings; null is an empty document.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .cache import content_key

TEXT_FIELD = "text"
HF_PREFIX = "hf:"
HF_MAX_BYTES = 2**30  # text read from a streamed dataset: about 250M tokens
DATA_SPEC_HELP = (
    "--data takes a .txt, .py, .jsonl or .parquet file (the first three also gzipped, e.g. .jsonl.gz), "
    "a directory or glob of them, or hf:NAME[:CONFIG]"
)


class DataSourceError(ValueError):
    """A ``--data`` value or a data file that cannot be used."""


class TextSource(ABC):
    name: str

    @abstractmethod
    def fingerprint(self) -> str:
        """Changes whenever the documents may have changed."""

    @abstractmethod
    def documents(self) -> Iterator[str]:
        """The non-empty documents, always in the same order."""

    def size_hint(self) -> int | None:
        """Approximate bytes of text, for progress bars; None if unknown."""
        return None


def take_bytes(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Documents until ``max_bytes`` of UTF-8 text have been yielded (the last one whole)."""
    n_bytes = 0
    for doc in documents:
        if n_bytes >= max_bytes:
            return
        yield doc
        n_bytes += len(doc.encode())


def decode_text(data: bytes, where: Path | str, first_line: int = 1) -> str:
    """``data`` as UTF-8 text, or a DataSourceError naming ``where`` and the line at fault."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise DataSourceError(
            f"{where}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); convert the file to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8) or leave it out of --data"
        ) from None
    if "\x00" in text:
        line = first_line + text.count("\n", 0, text.index("\x00"))
        raise DataSourceError(
            f"{where}:{line}: a NUL byte: this looks like a binary file, not text; leave it out of --data"
        )
    return text


def as_document(value: object, where: str) -> str:
    """A ``text`` value as a document: a string, or null for an empty one."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataSourceError(f"{where}: {TEXT_FIELD!r} holds a {type(value).__name__} ({value!r:.40}), not a string")
    return value


GZIP_SUFFIX = ".gz"
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # not gzip, cut short, corrupt stream


def file_format(path: Path) -> str:
    """The suffix that picks a file's reader: ``.jsonl`` for ``a.jsonl`` and ``a.jsonl.gz``."""
    return Path(path.stem).suffix if path.suffix == GZIP_SUFFIX else path.suffix


@contextlib.contextmanager
def _open_binary(path: Path) -> Iterator[BinaryIO]:
    """``path`` opened for binary reading, decompressed when it ends in ``.gz``; a damaged gzip
    stream, wherever it shows, is a DataSourceError naming the file."""
    if path.suffix != GZIP_SUFFIX:
        with open(path, "rb") as f:
            yield f
        return
    try:
        with gzip.open(path, "rb") as f:
            yield f
    except GZIP_ERRORS as e:
        raise DataSourceError(f"{path}: not a readable gzip file ({e}); check the file or decompress it") from None


def _read_text(path: Path) -> Iterator[str]:
    with _open_binary(path) as f:
        data = f.read()
    yield decode_text(data, path)


def _read_jsonl(path: Path) -> Iterator[str]:
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = decode_text(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSourceError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or TEXT_FIELD not in row:
                fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DataSourceError(f"{path}:{lineno}: no {TEXT_FIELD!r} field (found {fields})")
            yield as_document(row[TEXT_FIELD], f"{path}:{lineno}")


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq  # optional dependency: only parquet users need it

    try:  # a file cut short or damaged shows when its footer or a page is read
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
        if TEXT_FIELD not in columns:
            raise DataSourceError(f"{path}: no {TEXT_FIELD!r} column (columns: {', '.join(columns)})")
        row = 0
        for batch in parquet.iter_batches(columns=[TEXT_FIELD]):
            for value in batch.column(0).to_pylist():
                yield as_document(value, f"{path}: row {row}")
                row += 1
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # the file system's error: the caller says it
            raise
        raise DataSourceError(f"{path}: not a readable parquet file ({e}); check or re-download it") from None


READERS: dict[str, Callable[[Path], Iterator[str]]] = {
    ".txt": _read_text,
    ".py": _read_text,
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}
PLAIN_TEXT_SUFFIXES = (".txt", ".py")
GZIP_FORMATS = (".txt", ".py", ".jsonl")  # parquet compresses inside the file


def reader_for(path: Path) -> Callable[[Path], Iterator[str]] | None:
    """The reader of ``path`` by its suffix (``.jsonl.gz`` reads as ``.jsonl``), or None."""
    fmt = file_format(path)
    if path.suffix == GZIP_SUFFIX and fmt not in GZIP_FORMATS:
        return None
    return READERS.get(fmt)


SUPPORTED_HELP = f"{', '.join(READERS)} (and gzipped {', '.join(f + GZIP_SUFFIX for f in GZIP_FORMATS)})"


class FileSource(TextSource):
    """Local files, read in the given order."""

    def __init__(self, paths: list[Path], name: str | None = None) -> None:
        unsupported = [str(p) for p in paths if reader_for(p) is None]
        if unsupported:
            raise DataSourceError(
                f"unsupported file type: {', '.join(unsupported[:3])}; supported suffixes: {SUPPORTED_HELP}"
            )
        self.paths = paths
        self.name = name or (str(paths[0]) if len(paths) == 1 else f"{len(paths)} files")

    def fingerprint(self) -> str:
        stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.paths]
        return content_key("files", stats)

    def documents(self) -> Iterator[str]:
        for path in self.paths:
            yield from (doc for doc in reader_for(path)(path) if doc)

    def size_hint(self) -> int | None:
        if all(p.suffix in PLAIN_TEXT_SUFFIXES for p in self.paths):
            return sum(p.stat().st_size for p in self.paths)
        return None


class HFSource(TextSource):
    """A split of a Hugging Face dataset, streamed, first ``max_bytes`` of text only.

    ``data_files`` is passed through to ``datasets.load_dataset``, which lets a generic builder
    such as ``"json"`` or ``"parquet"`` stream local or remote files.
    """

    def __init__(
        self,
        path: str,
        config: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        max_bytes: int = HF_MAX_BYTES,
    ) -> None:
        self.path, self.config, self.split = path, config, split
        self.data_files, self.max_bytes = data_files, max_bytes
        self.name = HF_PREFIX + path + (f":{config}" if config else "")

    def fingerprint(self) -> str:
        return content_key("hf", self.path, self.config, self.split, self.data_files, self.max_bytes)

    def documents(self) -> Iterator[str]:
        try:
            import datasets
        except ImportError:
            raise DataSourceError(f"--data {self.name} needs Hugging Face datasets: pip install datasets") from None
        try:
            rows = datasets.load_dataset(
                self.path, self.config, split=self.split, data_files=self.data_files, streaming=True
            )
            yield from take_bytes(self._texts(rows), self.max_bytes)
        except DataSourceError:
            raise
        except Exception as e:  # no network, unknown name, gated dataset: whatever the hub says
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DataSourceError(
                f"--data {self.name}: cannot stream it from Hugging Face ({reason}); "
                "check the name and the network, or pass local files"
            ) from None

    def _texts(self, rows: Iterable[dict]) -> Iterator[str]:
        for index, row in enumerate(rows):
            if TEXT_FIELD not in row:
                raise DataSourceError(f"{self.name}: no {TEXT_FIELD!r} column (columns: {', '.join(row)})")
            if doc := as_document(row[TEXT_FIELD], f"{self.name}: row {index}"):
                yield doc

    def size_hint(self) -> int | None:
        return self.max_bytes


def _expand_paths(spec: str) -> list[Path]:
    if any(ch in spec for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not paths:
            raise DataSourceError(f"--data {spec!r}: the glob matches no files")
        return paths
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        paths = sorted(p for p in path.rglob("*") if reader_for(p) is not None and p.is_file())
        if not paths:
            raise DataSourceError(
                f"--data {spec!r}: no {', '.join(READERS)} files (or gzipped "
                f"{', '.join(f + GZIP_SUFFIX for f in GZIP_FORMATS)}) in this directory"
            )
        return paths
    raise DataSourceError(f"--data {spec!r}: no such file or directory; {DATA_SPEC_HELP}")


def parse_data_spec(spec: str) -> TextSource:
    """The source named by a ``--data`` value (see the module docstring)."""
    if spec.startswith(HF_PREFIX):
        name, _, config = spec[len(HF_PREFIX) :].partition(":")
        if not name:
            raise DataSourceError(f"--data {spec!r}: missing dataset name; {DATA_SPEC_HELP}")
        return HFSource(name, config or None)
    return FileSource(_expand_paths(spec), name=spec)
