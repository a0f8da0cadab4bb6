"""What a ``TrainConfig`` describes, built: the device, the converted model and the data.

These are the entry points for tools that read a run back (``adahop analyze``)::

    cfg = load_config(run_dir / "config.toml")
    model = build_model_from_config(cfg)
    load_checkpoint(run_dir, model)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..data import BatchLoader, Tokenizer, prepare_data, validation_batches
from ..data.loader import num_windows
from ..models import Transformer, build_model
from ..nn import convert_model
from .config import ConfigError, TrainConfig

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
    left untouched) and converted with its recipe; the LM head stays high precision."""
    device = torch.device(device)
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices), device:
        torch.manual_seed(cfg.training.seed)
        model = build_model(cfg.model.preset, vocab_size=cfg.data.vocab_size, **cfg.model.overrides)
    return convert_model(model, cfg.recipe)


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
