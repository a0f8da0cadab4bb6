"""Host-side helpers of the kernel launchers (no device code): grids, the Philox key pointer and
the compile-time arguments every quantize kernel takes.

``INTERPRET`` tells launchers that Triton runs its interpreter (``TRITON_INTERPRET=1``: CPU
tensors, no autotuning, which needs a real device).
"""

from __future__ import annotations

import functools
import os

import torch

from ..formats.elements import ElementFormat, encode_e2m1, encode_fp8
from ..formats.mx import ELEMENT_FORMATS

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids: ``triton.cdiv`` is a JIT function, and calling one
    from Python costs a noticeable share of a kernel launch."""
    return -(-a // b)


@functools.cache
def max_code(efmt: ElementFormat) -> int:
    """Code of the largest finite element, where saturation clamps."""
    top = torch.tensor([efmt.max_normal])
    return int((encode_e2m1(top) if efmt.bits == 4 else encode_fp8(top, efmt))[0])


def common_constexprs(
    dtype: torch.dtype, on_cuda: bool, fmt: str, scale_rule: str, rounding: str, has_signs: bool, scores: bool
) -> dict:
    """Compile-time arguments every quantize kernel takes: input handling, scale rule, rounding,
    the element format's facts, and whether it records each output row's outlier score."""
    efmt = ELEMENT_FORMATS[fmt]
    return dict(
        SCORES=scores,
        INPUT_BF16=dtype == torch.bfloat16,
        ROUND_TO={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, ""),
        NATIVE_CASTS=on_cuda,
        HAS_SIGNS=has_signs,
        RULE=scale_rule,
        STOCHASTIC=rounding == "stochastic",
        EMAX=efmt.emax,
        EMIN=efmt.emin,
        MBITS=efmt.mbits,
        MAX_NORMAL=efmt.max_normal,
        MAX_CODE=max_code(efmt),
    )


@functools.cache
def zero_seed(device: torch.device) -> torch.Tensor:
    """The key a round-to-nearest launch passes (and never uses): one tensor per device, made
    outside any CUDA-graph capture."""
    return torch.zeros((), dtype=torch.int64, device=device)


def seed_pointer(device: torch.device, seed: int | torch.Tensor | None) -> torch.Tensor:
    """The Philox key as an int64 scalar on ``device``. Kernels read it from memory rather than
    take it as an argument, so a captured CUDA graph replays with whatever seed the step drew
    on the device, instead of the one baked in at capture."""
    if seed is None:
        return zero_seed(device)
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    return torch.tensor(seed, dtype=torch.int64, device=device)
