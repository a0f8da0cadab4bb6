"""adahop: fast, accurate MXFP4 training for PyTorch.

The layers, from numbers up:

- ``adahop.formats``     MX element grids, E8M0 scale rules, the reference quantizer (the spec)
- ``adahop.transforms``  block Hadamard transforms
- ``adahop.policy``      outlier patterns, strategy tables, calibration and frozen plans
- ``adahop.gemm``        one GEMM under a strategy: operand preparation and the product
- ``adahop.ops``         torch.library custom ops: reference anywhere, Triton kernels on CUDA
- ``adahop.kernels``     Triton kernels, tested bit-for-bit against the reference
- ``adahop.nn``          ``AdaHOPLinear`` and ``convert_model``
- ``adahop.recipes``     ``Recipe``: every knob, registered by name
- ``adahop.models``, ``adahop.data``, ``adahop.train``   the trainer behind ``adahop train``
- ``adahop.analysis``, ``adahop.bench``   ``adahop compare`` / ``analyze`` / ``bench``
"""

from .formats import MXTensor, quantize_mx
from .nn import AdaHOPLinear, convert_model, load_plan, model_plan
from .policy import detect_pattern, pattern_stats
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
from .transforms import hadamard_transform

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES",
    "AdaHOPLinear",
    "MXTensor",
    "Recipe",
    "convert_model",
    "detect_pattern",
    "get_recipe",
    "hadamard_transform",
    "load_plan",
    "model_plan",
    "pattern_stats",
    "quantize_mx",
    "__version__",
]
