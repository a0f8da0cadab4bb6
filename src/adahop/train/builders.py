"""What a ``TrainConfig`` describes, built: the device, the converted model and the data.

These are the entry points for tools that read a run back (``adahop analyze``, ``adahop eval``)::

    cfg = load_config(run_dir / "config.toml")
    model = build_model_from_config(cfg)
    load_checkpoint(run_dir, model)

or, in one call, ``model, cfg, state = load_run(run_dir_or_checkpoint)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pathlib import Path
from typing import Any

from ..data import BatchLoader, Tokenizer, prepare_data, validation_batches
from ..data.loader import num_windows
from ..models import Transformer, build_model
from ..nn import convert_model
from .checkpoint import load_checkpoint, resolve_checkpoint
from .config import ConfigError, TrainConfig, load_config

Batch = tuple[torch.Tensor, torch.Tensor]


def resolve_device(device: str) -> torch.device:
    """``"auto"``: the current CUDA device when there is one, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(device)


def build_model_from_config(cfg: TrainConfig, device: str | torch.device = "cpu") -> Transformer:
    """The config's model, initialised from ``training.seed`` alone (the global random state is
    left untouched) and converted with its recipe (or, for a ``torchao_float8`` peer recipe, with
    torchao's float8); the LM head stays high precision."""
    device = torch.device(device)
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), device:
        torch.manual_seed(cfg.training.seed)
        model = build_model(cfg.model.preset, vocab_size=cfg.data.vocab_size, **cfg.model.overrides)
    if cfg.recipe.torchao_float8:
        from ..integrations.float8 import convert_to_float8

        return convert_to_float8(model, cfg.recipe, device)
    return convert_model(model, cfg.recipe)


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, TrainConfig, dict[str, Any]]:
    """(model, config, checkpoint state) of a run directory's latest checkpoint or of a checkpoint
    file inside ``<run>/checkpoints/``; ``state["path"]`` is the checkpoint, ``state["step"]`` its step."""
    checkpoint = resolve_checkpoint(path)
    cfg = load_config(checkpoint.parent.parent / "config.toml")
    model = build_model_from_config(cfg, device)
    state = load_checkpoint(checkpoint, model, config=cfg.to_dict())
    return model, cfg, state


def autocast_for(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    """BF16 autocast on CUDA when ``training.autocast`` is set, disabled elsewhere."""
    enabled = device.type == "cuda" and cfg.training.autocast
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: Iterable[Batch], cfg: TrainConfig, device: torch.device) -> float:
    """Mean next-token loss over ``batches``, weighted by tokens, in eval mode (restored after)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        with autocast_for(cfg, device):
            _, loss = model(inputs.to(device), targets.to(device))
        total += loss.item() * targets.numel()
        count += targets.numel()
    model.train(was_training)
    return total / count


@dataclass
class ValidationSet:
    """The fixed held-out batches: the same windows, in the same order, on every pass."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    max_batches: int

    def __iter__(self) -> Iterator[Batch]:
        return validation_batches(self.tokens, self.batch_size, self.seq_len, self.max_batches)


@dataclass
class TrainData:
    tokenizer: Tokenizer
    train: BatchLoader  # endless, resumable (``state_dict``)
    val: ValidationSet
    source: str  # human-readable name of the data source


_HASH_CHUNK = 1 << 24  # tokens per hashed slice: a memory-mapped corpus is read once, in pieces


def data_fingerprint(data: TrainData) -> dict[str, Any]:
    """What the run trains on, by content: the source's name, its token count and a SHA-256 of
    its token ids (training, then validation) and of the tokenizer, so a source that was edited,
    replaced or tokenized otherwise shows, while one only touched or moved does not. Reads the
    tokens once (about 1 s per 2 GB)."""
    digest = hashlib.sha256(data.tokenizer.fingerprint().encode())
    for tokens in (data.train.tokens, data.val.tokens):
        for start in range(0, len(tokens), _HASH_CHUNK):
            digest.update(np.ascontiguousarray(tokens[start : start + _HASH_CHUNK]).data)
    return {
        "source": data.source,
        "tokens": len(data.train.tokens) + len(data.val.tokens),
        "sha256": digest.hexdigest(),
    }


def build_data(cfg: TrainConfig, progress: bool = True, *, rank: int = 0, world_size: int = 1) -> TrainData:
    """Tokenizer and train/validation batches for ``cfg.data`` (tokenized once, then cached);
    the training batches are rank ``rank``'s share of each global batch of ``world_size`` ranks.
    Every rank sees all validation batches (each forward of a sharded model needs every rank)."""
    d = cfg.data
    tokens = prepare_data(d.source, d.vocab_size, d.val_fraction, progress=progress)
    if num_windows(tokens.val, d.seq_len) == 0:  # fail now, not at the first validation
        raise ValueError(
            f"the validation split of {tokens.source} has {len(tokens.val)} tokens, fewer than "
            f"seq_len + 1 = {d.seq_len + 1}; raise data.val_fraction or use more data"
        )
    train = BatchLoader(tokens.train, d.batch_size, d.seq_len, seed=cfg.training.seed, rank=rank, world_size=world_size)
    val = ValidationSet(tokens.val, d.batch_size, d.seq_len, cfg.logging.val_batches)
    return TrainData(tokens.tokenizer, train, val, tokens.source)
