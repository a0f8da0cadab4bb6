"""MX number formats: element grids, E8M0 scale rules, the reference quantizer, the quantization spec."""

from .mx import ELEMENT_FORMATS, ROUNDING_MODES, MXTensor, quantize_mx
from .scales import SCALE_RULES
from .spec import DEFAULT_SPEC, QuantSpec
from .tiles import quantize_mx_tiles

__all__ = [
    "DEFAULT_SPEC",
    "ELEMENT_FORMATS",
    "ROUNDING_MODES",
    "SCALE_RULES",
    "MXTensor",
    "QuantSpec",
    "quantize_mx",
    "quantize_mx_tiles",
]
