"""The weights a training step quantizes: every linear layer of a preset but the LM head (which
``nn.convert`` leaves in high precision), read from the model itself, built on the meta device."""

from __future__ import annotations

import torch

from adahop.models.llama import build_model


def linear_weight_shapes(preset: str, **overrides) -> list[tuple[str, tuple[int, int]]]:
    """(name, [out, in]) of each converted linear layer's weight, in the model's order (``overrides``: of
    ``ModelArgs``, as ``build_model`` takes them)."""
    with torch.device("meta"):
        model = build_model(preset, **overrides)
    return [
        (name, tuple(module.weight.shape))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "output"
    ]
