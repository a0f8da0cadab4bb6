"""adahop: fast, accurate MXFP4 training for PyTorch.

Public API (see README): ``quantize_mx``, ``MXTensor``, ``hadamard_transform``,
``detect_pattern``, ``pattern_stats``, ``AdaHOPLinear``, ``convert_model``, ``Recipe``.
"""

from .formats import MXTensor, quantize_mx
from .transforms import hadamard_transform

__version__ = "0.1.0"

__all__ = ["MXTensor", "quantize_mx", "hadamard_transform", "__version__"]
