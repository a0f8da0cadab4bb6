"""PyTorch modules and model conversion."""

from .convert import adahop_layers, convert_model, load_plan, model_plan, set_bf16_forward
from .linear import AdaHOPLinear

__all__ = ["AdaHOPLinear", "adahop_layers", "convert_model", "load_plan", "model_plan", "set_bf16_forward"]
