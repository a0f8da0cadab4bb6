"""MX number formats: element grids, E8M0 scale rules, the reference quantizer."""

from .mx import ELEMENT_FORMATS, ROUNDING_MODES, MXTensor, quantize_mx
from .scales import SCALE_RULES
from .tiles import quantize_mx_tiles

__all__ = ["ELEMENT_FORMATS", "ROUNDING_MODES", "SCALE_RULES", "MXTensor", "quantize_mx", "quantize_mx_tiles"]
