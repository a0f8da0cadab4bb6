"""A byte-level BPE tokenizer, trained once per source and cached.

Byte-level BPE needs no download, never produces unknown tokens and decodes any text back
exactly. Training reads only the first ``TOKENIZER_TRAIN_BYTES`` of the source, which takes a
few seconds; for a source smaller than that, the tokenizer has also seen the validation text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..atomic import atomic_file, remove_stale_temp_files
from .cache import cache_dir, content_key
from .sources import TextSource, take_bytes

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
TOKENIZER_TRAIN_BYTES = 4 * 2**20


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with an end-of-document token."""

    def __init__(self, bpe: tokenizers.Tokenizer) -> None:
        self._bpe = bpe
        eos_id = bpe.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token")
        self.eos_id: int = eos_id

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def to_json(self) -> str:
        return self._bpe.to_str()

    @property
    def vocab_size(self) -> int:
        return self._bpe.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        return content_key("tokenizer", self.to_json())

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._bpe.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._bpe.decode(list(ids), skip_special_tokens=False)


def train_tokenizer(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE with ``EOS_TOKEN`` as token 0."""
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    bpe.train_from_iterator(texts, trainer)
    return Tokenizer(bpe)


def load_tokenizer(
    source: TextSource,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache: str | os.PathLike | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """The cached tokenizer for ``source`` and ``vocab_size``, trained on first use."""
    key = content_key("bpe", source.fingerprint(), vocab_size, TOKENIZER_TRAIN_BYTES)
    path = cache_dir(cache) / "tokenizers" / f"{key}.json"
    if path.exists():
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            log.warning("warning: cached tokenizer %s is damaged (%s); training it again", path, e)
    remove_stale_temp_files(path.parent)
    tokenizer = train_tokenizer(take_bytes(source.documents(), TOKENIZER_TRAIN_BYTES), vocab_size, show_progress)
    with atomic_file(path) as f:
        f.write(tokenizer.to_json().encode())
    return tokenizer
