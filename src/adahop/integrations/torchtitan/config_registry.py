"""Ready-made torchtitan >= 0.3 configs: ``--module adahop.integrations.torchtitan --config NAME``."""

from __future__ import annotations

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from .config_converter import AdaHOPConverter


def llama3_debugmodel_adahop() -> Trainer.Config:
    """torchtitan's llama3 debug model with every transformer-block linear layer under the default recipe."""
    config = llama3_debugmodel()
    compiled = config.compile.enable and "model" in config.compile.components
    config.model_spec = model_registry(
        "debugmodel", converters=[AdaHOPConverter.Config(model_compile_enabled=compiled)]
    )
    return config
