"""torchao's float8 training as a peer recipe (``torchao_float8_tensorwise``, ``torchao_float8_rowwise``).

The FP8 recipe a Hopper user would pick instead of adahop: every linear layer that AdaHOP would convert
(not the LM head: ``nn.convert.conversion_verdict``, the one rule) becomes torchao's
``Float8Linear`` (``convert_to_float8_training``), so ``adahop train`` measures the peer's loss with
our data, seeds and harness, and the step bench its speed, through this one function. torchao is not
a dependency of adahop (it is in the ``test`` extra); a recipe that needs it says so in one line.
"""

from __future__ import annotations

import functools
from importlib.util import find_spec

import torch
from torch import nn

from ..nn.convert import conversion_verdict
from ..recipes import Recipe

FLOAT8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on


@functools.cache
def _cpu_scaled_mm_works() -> bool:
    """Whether this torch runs float8 GEMMs on the CPU (torch 2.13 does; older builds may not)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def check_float8(recipe: Recipe, device: torch.device) -> None:
    """Raise a one-line ValueError unless torchao's float8 training can run ``recipe`` on ``device``."""
    if find_spec("torchao") is None:
        raise ValueError(
            f"recipe {recipe.name!r} trains with torchao's float8, and torchao is not installed: "
            "pip install torchao (it is in adahop's test extra, not a dependency)"
        )
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_MIN_CAPABILITY:
            raise ValueError(
                f"recipe {recipe.name!r}: torchao's float8 needs an FP8 GPU (sm_89 or newer), this one is "
                f"sm_{capability[0]}{capability[1]}; pick another recipe"
            )
    elif device.type != "cpu" or not _cpu_scaled_mm_works():
        raise ValueError(
            f"recipe {recipe.name!r}: torchao's float8 cannot run on {device} with torch {torch.__version__} "
            "(no float8 GEMM there); train it on an FP8 GPU (sm_89 or newer)"
        )


def convert_to_float8(model: nn.Module, recipe: Recipe, device: torch.device | str = "cpu") -> nn.Module:
    """``model`` (plain ``nn.Linear`` layers) with every linear layer that ``convert_model`` would
    convert (``nn.convert.conversion_verdict``: not the LM head) swapped in place for torchao's
    ``Float8Linear`` of ``recipe.torchao_float8`` scaling; returns it."""
    check_float8(recipe, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe.torchao_float8)

    def converted(module: nn.Module, fqn: str) -> bool:
        return conversion_verdict(fqn, module.in_features, module.out_features, recipe) is None

    return convert_to_float8_training(model, config=config, module_filter_fn=converted)
