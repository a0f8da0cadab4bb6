"""MX element formats (OCP Microscaling v1.0, section 5) and rounding onto their grids.

This module is the specification of element rounding: the Triton kernels are tested
bit-for-bit against it. Values are rounded with float32 arithmetic that is exact:
``|v| / quantum`` divides by a power of two, so the only rounding is the explicit one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .philox import NOISE_BITS

NOISE_SCALE = float(2**NOISE_BITS)  # stochastic-rounding noise is n / NOISE_SCALE, n an integer


@dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa element type without Inf/NaN codes in MX use (saturating)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    bits: int  # storage bits per element

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (subnormals share its quantum)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (``emax_elem`` in the spec)."""
        return math.floor(math.log2(self.max_normal))


E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max_normal=6.0, bits=4)
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0, bits=8)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max_normal=57344.0, bits=8)

# The values an E2M1 code 0..7 stands for (code 8..15 are the negatives).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def element_quantum(absval: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Spacing of the element grid around ``absval`` (float32): 2**(max(floor(log2|v|), emin) - mbits)."""
    _, exp = torch.frexp(absval)  # absval = m * 2**exp, m in [0.5, 1)
    e = torch.clamp(exp - 1, min=fmt.emin)
    return torch.ldexp(torch.ones_like(absval), e - fmt.mbits)


def round_to_element(v: torch.Tensor, fmt: ElementFormat, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``v`` (already divided by the block scale) onto ``fmt``'s grid.

    ``noise is None``: round-to-nearest-even. Otherwise stochastic rounding,
    ``floor(|v| / quantum + noise) * quantum`` with ``noise`` uniform on the ``2**-8`` grid
    in [0, 1) (``formats.philox``), which is unbiased below the saturation point: exactly for
    bfloat16 inputs down to half the smallest quantum, to within ``quantum / 256`` (toward zero)
    otherwise (``formats.philox`` says why). The sum is exact: ``floor(s + n / 2**8) =
    floor((floor(s * 2**8) + n) / 2**8)`` for an integer ``n``, and every step of the right side
    is exact in float32.
    Both modes saturate at ``max_normal``; the sign is kept (so tiny negatives become -0).
    """
    a = v.abs()
    quantum = element_quantum(a, fmt)
    steps = a / quantum
    if noise is None:
        steps = torch.round(steps)
    else:
        fixed = torch.floor(steps * NOISE_SCALE) + noise * NOISE_SCALE  # integers below 2**13
        steps = torch.floor(fixed / NOISE_SCALE)
    q = torch.clamp(steps * quantum, max=fmt.max_normal)
    return torch.copysign(q, v)


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of values already on the E2M1 grid."""
    lut = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8, device=q.device)
    code = lut[(q.abs() * 2).to(torch.int64)]
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).to(torch.int64)]
    return torch.where((code & 8) != 0, -mag, mag)


_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def encode_fp8(q: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Bit patterns (uint8) of values already on an FP8 grid; the cast is exact there."""
    return q.to(_FP8_DTYPES[fmt.name]).view(torch.uint8)


def decode_fp8(code: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    return code.view(_FP8_DTYPES[fmt.name]).to(torch.float32)
