"""Host-side helpers of the kernel launchers (no device code): grids, the Philox key pointer and
the compile-time description every quantize kernel takes (``QuantizeSpec``).

``INTERPRET`` tells launchers that Triton runs its interpreter (``TRITON_INTERPRET=1``: CPU
tensors, no autotuning, which needs a real device).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class QuantizeSpec:
    """What a quantize kernel computes, as one compile-time argument (``SPEC``) whose fields device
    code reads (``SPEC.rule``): the input's handling, the Hadamard, the element format, the scale
    rule, the rounding, and whether it records each output row's outlier score. Tiles and shapes
    stay separate constexprs. Frozen and hashable: Triton keys its compiled kernels on it. Triton
    passes a numeric field on to another function as a constexpr but not a string one: bind that to
    a name annotated ``tl.constexpr`` first (``RULE: tl.constexpr = SPEC.rule``)."""

    fmt: str  # the element format's name: the facts below are its
    input_bf16: bool  # bfloat16 input, loaded as int16 bits
    round_to: str  # the Hadamard's output rounded to the input dtype, as the reference does: "bf16", "fp16", ""
    native_casts: bool  # hardware conversions (CUDA); bit arithmetic in the interpreter, whose casts are wrong
    hadamard: int  # Hadamard block size, 0 for none
    has_signs: bool  # the Hadamard's random signs
    block_size: int
    element_bits: int
    emax: int
    emin: int
    mbits: int
    max_normal: float
    max_code: int  # the code of the largest finite element, where saturation clamps
    rule: str
    stochastic: bool
    scores: bool

    @property
    def hadamard_stages(self) -> int:
        """Butterfly stages of the Hadamard: log2 of its size."""
        return max(self.hadamard.bit_length() - 1, 0)

    @property
    def codes_per_unit(self) -> int:
        """Codes per store unit: a 32-bit word where a block fills whole words, else a byte."""
        unit_bits = 32 if self.block_size * self.element_bits % 32 == 0 else 8
        return unit_bits // self.element_bits


@functools.lru_cache(maxsize=1024)
def quantize_spec(
    dtype: torch.dtype,
    on_cuda: bool,
    fmt: str,
    block_size: int,
    scale_rule: str,
    rounding: str,
    hadamard: int,
    has_signs: bool,
    scores: bool,
) -> QuantizeSpec:
    """The ``SPEC`` of a quantize launch (arguments by position where the names match)."""
    efmt = ELEMENT_FORMATS[fmt]
    return QuantizeSpec(
        fmt=fmt,
        input_bf16=dtype == torch.bfloat16,
        round_to={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, ""),
        native_casts=on_cuda,
        hadamard=hadamard,
        has_signs=has_signs,
        block_size=block_size,
        element_bits=efmt.bits,
        emax=efmt.emax,
        emin=efmt.emin,
        mbits=efmt.mbits,
        max_normal=efmt.max_normal,
        max_code=max_code(efmt),
        rule=scale_rule,
        stochastic=rounding == "stochastic",
        scores=scores,
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
