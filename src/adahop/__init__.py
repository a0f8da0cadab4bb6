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

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

# The names below load on first use (PEP 562), so ``import adahop`` and the ``adahop`` command's own
# ``--help`` and ``--version`` do not import torch; each subcommand imports what it runs.
_EXPORTS = {
    "MXTensor": ".formats",
    "quantize_mx": ".formats",
    "AdaHOPLinear": ".nn",
    "convert_model": ".nn",
    "load_plan": ".nn",
    "model_plan": ".nn",
    "detect_pattern": ".policy",
    "end_calibration_step": ".policy",
    "pattern_stats": ".policy",
    "DEFAULT_RECIPE": ".recipes",
    "RECIPES": ".recipes",
    "Recipe": ".recipes",
    "get_recipe": ".recipes",
    "hadamard_transform": ".transforms",
}

if TYPE_CHECKING:
    from .formats import MXTensor, quantize_mx
    from .nn import AdaHOPLinear, convert_model, load_plan, model_plan
    from .policy import detect_pattern, end_calibration_step, pattern_stats
    from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
    from .transforms import hadamard_transform

try:
    __version__ = version("adahop")  # one source: pyproject.toml's version
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:  # a subpackage, as ``import adahop`` used to load them all (``adahop.policy.ModelPlan``)
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'adahop' has no attribute {name!r}") from None
    globals()[name] = value  # the next access does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "DEFAULT_RECIPE",
    "RECIPES",
    "AdaHOPLinear",
    "MXTensor",
    "Recipe",
    "convert_model",
    "detect_pattern",
    "end_calibration_step",
    "get_recipe",
    "hadamard_transform",
    "load_plan",
    "model_plan",
    "pattern_stats",
    "quantize_mx",
    "__version__",
]
