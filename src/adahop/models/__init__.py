"""Models trained by ``adahop train``."""

from .llama import (
    MODEL_PRESETS,
    ModelArgs,
    Transformer,
    build_model,
    flops_per_token,
    get_model_args,
    num_params,
)

__all__ = [
    "MODEL_PRESETS",
    "ModelArgs",
    "Transformer",
    "build_model",
    "flops_per_token",
    "get_model_args",
    "num_params",
]
