"""Triton device functions that read MX storage: FP4 nibble unpacking, E2M1 and E8M0 decoding.

They use integer arithmetic and bitcasts only, so they are exact under ``TRITON_INTERPRET=1``
too (the interpreter's float8 ``.to`` casts round wrongly). ``INTERPRET`` tells launchers to
skip autotuning, which needs a real device.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids: ``triton.cdiv`` is a JIT function, and calling one
    from Python costs a noticeable share of a kernel launch."""
    return -(-a // b)

_FP32_HALF_BITS = tl.constexpr(0x3F000000)  # 0.5 in float32
_FP32_NAN_BITS = tl.constexpr(0x7FC00000)
_E4M3_HALF_BITS = tl.constexpr(0x30)  # 0.5 in E4M3: exponent field 6, bias 7


@triton.jit
def unpack_fp4(packed):
    """[R, C] bytes -> [R, 2C] E2M1 codes, the low nibble first (the MXTensor layout)."""
    codes = tl.join(packed & 0xF, packed >> 4)
    return tl.reshape(codes, (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def e2m1_to_fp32(codes):
    """float32 values of E2M1 codes, built from bits: 0.5 * q for q < 2, else q << 22 added to 0.5."""
    q = (codes & 7).to(tl.int32)
    bits = tl.where(q < 2, q * _FP32_HALF_BITS, (q << 22) + _FP32_HALF_BITS)
    bits = bits | ((codes & 8).to(tl.int32) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_e4m3(codes):
    """E4M3 bit patterns (uint8) of E2M1 codes; every E2M1 value is exact in E4M3.

    An E2M1 code ``q = 2 * exp + mantissa`` maps to ``q << 2`` re-biased by 0.5's pattern;
    the subnormal 0.5 (q = 1) and zero are the two exceptions.
    """
    q = codes & 7
    mag = tl.where(q < 2, q * _E4M3_HALF_BITS, (q << 2) + _E4M3_HALF_BITS)
    return mag | ((codes & 8) << 4)


@triton.jit
def e8m0_to_fp32(codes):
    """float32 ``2**(code - 127)`` of E8M0 codes, exact (code 0 is subnormal); NaN for 255."""
    c = codes.to(tl.int32)
    bits = tl.where(c == 0, 1 << 22, c << 23)
    bits = tl.where(c == 255, _FP32_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)
