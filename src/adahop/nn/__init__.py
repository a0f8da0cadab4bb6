"""PyTorch modules and model conversion."""

from .convert import adahop_layers, convert_model, load_plan, model_plan, set_bf16_forward
from .linear import AdaHOPLinear
from .oscillation import OsciReset
from .weight_cache import weight_operands_cached

__all__ = [
    "AdaHOPLinear",
    "OsciReset",
    "adahop_layers",
    "convert_model",
    "load_plan",
    "model_plan",
    "set_bf16_forward",
    "weight_operands_cached",
]
