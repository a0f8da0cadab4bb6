"""What a run that stopped on an error of the machine's (memory, disk) says in its one line:
what ran out, for what, and what to do. The CLI adds where the run stopped and how to resume."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path

import torch

from ..data.cache import CACHE_ENV, cache_dir
from ..models import build_model, num_params
from .config import TrainConfig

# Bytes per parameter of training state: FP32 weights and gradients, AdamW's two FP32 moments.
TRAINING_BYTES_PER_PARAM = 16


def out_of_memory(error: BaseException) -> bool:
    """A GPU or CPU allocation that failed (the CPU allocator raises a plain RuntimeError)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def describe_out_of_memory(cfg: TrainConfig, device: torch.device | str) -> str:
    """The model's size (built on the meta device: no memory) and the ways to fit it."""
    args = cfg.model_args()
    with torch.device("meta"):
        params = num_params(build_model(cfg.model.preset, **dataclasses.asdict(args)))
    state_gib = params * TRAINING_BYTES_PER_PARAM / 2**30
    return (
        f"out of memory on {device}: model {cfg.model.preset}{' (with model.overrides)' if cfg.model.overrides else ''} "
        f"has {params / 1e6:,.1f}M parameters, "
        f"{state_gib:,.1f} GiB of FP32 weights, gradients and AdamW state before any activation; "
        "choose a smaller --model, lower data.batch_size or data.seq_len (raise training.grad_accum "
        "to keep the tokens per step), or shard it over several GPUs (torchrun, FSDP2)"
    )


def describe_write_failure(error: OSError, run_dir: Path) -> str:
    """``cannot write FILE: why``; for a full disk of the tokenizer cache, which one and what to do
    (the run directory is not at fault: nothing there needs deleting)."""
    target = Path(error.filename or run_dir)
    line = f"cannot write {target}: {error.strerror or error}"
    cache = cache_dir()
    if error.errno == errno.ENOSPC and target.resolve().is_relative_to(cache.resolve()):
        line += (
            f"; the disk of the tokenizer and token cache {cache} is full: free space there, "
            f"or point {CACHE_ENV} at a directory on a disk with room"
        )
    return line
