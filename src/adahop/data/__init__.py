"""Training data: sources, the embedded corpus, the tokenizer, token caches and batches.

``prepare_data(--data value)`` gives the tokenizer and the train/validation token arrays;
``BatchLoader`` and ``validation_batches`` turn those into batches.
"""

from .corpus import stdlib_source
from .dataset import EMBEDDED_SOURCE, TokenData, prepare_data, resolve_source
from .loader import BatchLoader, validation_batches
from .sources import DataSourceError, FileSource, HFSource, TextSource, parse_data_spec
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "EMBEDDED_SOURCE",
    "BatchLoader",
    "DataSourceError",
    "FileSource",
    "HFSource",
    "TextSource",
    "TokenData",
    "Tokenizer",
    "load_tokenizer",
    "parse_data_spec",
    "prepare_data",
    "resolve_source",
    "stdlib_source",
    "validation_batches",
]
