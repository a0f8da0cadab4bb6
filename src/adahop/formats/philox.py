"""Counter-based random numbers for stochastic rounding, identical on CPU and in Triton.

``uniform(seed, offsets)`` is Philox4x32-10 (Salmon et al., the generator behind Triton's
``tl.randint``) keyed by ``seed`` and counted by ``offsets``, mapped to [0, 1) as
``(bits >> 8) * 2**-24`` so the float conversion is exact. A Triton kernel that calls
``tl.randint(seed, offset)`` and applies the same mapping draws bit-identical noise, which makes
stochastic rounding testable bit-for-bit and resumable from a checkpoint.
"""

from __future__ import annotations

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
UNIFORM_BITS = 24
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and uint32 values in int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48: exact in int64
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox_bits(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """First 32-bit Philox4x32-10 output word (as int64) for counters ``(offset, 0, 0, 0)``."""
    seed &= (1 << 64) - 1
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    offsets = offsets.to(torch.int64)
    c0, c1 = offsets & _MASK32, (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0


def uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """float32 noise in [0, 1) with 24 random bits, one value per offset."""
    bits = philox_bits(seed, offsets) >> (32 - UNIFORM_BITS)
    return bits.to(torch.float32) * (2.0**-UNIFORM_BITS)
