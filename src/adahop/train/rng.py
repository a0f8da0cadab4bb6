"""The random generators a training step may draw from, as checkpoint state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Torch CPU/CUDA (stochastic-rounding seeds come from these), Python's and NumPy's
    generators (NumPy's as plain lists for weights_only)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (kind, key.tolist(), pos, has_gauss, gauss),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]  # lists, when read back from JSON (sharded checkpoints)
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
