"""Counter-based random numbers for stochastic rounding, identical on CPU and in Triton.

``uniform(seed, offsets)`` is Philox4x32-10 (Salmon et al., SC'11: the generator behind
cuRAND's default and Triton's ``tl.philox``) keyed by the 64-bit ``seed``. One call turns a
128-bit counter into four 32-bit words, and all four are used: the element at ``offset`` takes
word ``offset % 4`` of the call with counter ``(offset // 4, 0, 0, 0)``, as cuRAND's
``curand_uniform4`` does. A kernel therefore runs one Philox call per four neighbouring
elements (a quarter of the 10 rounds' work per element). The statistics are Philox's own: its
output stream, all four words of consecutive counters, passes TestU01's BigCrush (Salmon et al.,
Table 2), so neighbours that share a call are as independent as neighbours that do not.

A word maps to [0, 1) as ``(bits >> 8) * 2**-24``: 24 random bits, an exact float32.
A Triton kernel that applies the same mapping to ``tl.philox`` at the same counters draws
bit-identical noise, which makes stochastic rounding testable bit for bit and resumable from a
checkpoint.
"""

from __future__ import annotations

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
WORDS_PER_CALL = 4
UNIFORM_BITS = 24
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and uint32 values in int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48: exact in int64
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox4x32(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """The four Philox4x32-10 output words (uint32 values in int64, last axis) per counter.

    The 128-bit counter is ``(counter mod 2**32, counter >> 32, 0, 0)``, the key
    ``(seed mod 2**32, (seed >> 32) mod 2**32)``.
    """
    seed &= (1 << 64) - 1
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    counters = counters.to(torch.int64)
    c0, c1 = counters & _MASK32, (counters >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """float32 noise in [0, 1) with 24 random bits, one value per (non-negative) offset."""
    offsets = offsets.to(torch.int64)
    words = philox4x32(seed, offsets // WORDS_PER_CALL)
    bits = words.gather(-1, (offsets % WORDS_PER_CALL).unsqueeze(-1)).squeeze(-1)
    return (bits >> (32 - UNIFORM_BITS)).to(torch.float32) * (2.0**-UNIFORM_BITS)
