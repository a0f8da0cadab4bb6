"""PyTorch modules and model conversion."""

from .convert import adahop_layers, convert_model, load_plan, model_plan
from .linear import AdaHOPLinear

__all__ = ["AdaHOPLinear", "adahop_layers", "convert_model", "load_plan", "model_plan"]
