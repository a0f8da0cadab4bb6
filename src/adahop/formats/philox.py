"""Counter-based random numbers for stochastic rounding, identical on CPU and in Triton.

``uniform(seed, offsets)`` is Philox4x32-10 (Salmon et al., SC'11: the generator behind
cuRAND's default and Triton's ``tl.philox``) keyed by the 64-bit ``seed``. One call turns a
128-bit counter into four 32-bit words, 128 random bits, and each element takes 8 of them: the
element at ``offset`` takes byte ``offset % 4`` (lowest byte first) of word ``(offset // 4) % 4``
of the call with counter ``(offset // 16, 0, 0, 0)``. A kernel therefore runs one Philox call per
sixteen neighbouring elements (a sixteenth of the 10 rounds' work per element; the rounds were
most of the cost of stochastic rounding). The statistics are Philox's own: its output stream, all
bits of consecutive counters, passes TestU01's BigCrush (Salmon et al., Table 2), so neighbours
that share a call are as independent as neighbours that do not.

Why 8 bits are enough: stochastic rounding to a grid needs the probability ``frac(|v| /
quantum)``, and noise on a ``2**-8`` grid resolves it exactly whenever ``|v| / quantum`` has at
most 8 fractional bits. The quantizers' inputs are bfloat16 (the Hadamard output is rounded back to
the input dtype too), 8 significant bits, and dividing by the power-of-two block scale keeps
them; so ``|v| / quantum`` has ``7 - mbits`` fractional bits in the element format's normal range
(6 for E2M1) and one more per binade below it, at most 8 down to half the smallest quantum
(``|v| >= 0.25`` for E2M1). There the mean of the rounded value is exactly ``v`` (below
saturation). Below that, and for float16 or float32 inputs, the noise sees ``|v| / quantum``
truncated to 8 fractional bits: a bias under ``quantum / 256``, toward zero (0.4% of a step, where
16 bits gave 0.0015% for every input). ``tests/test_formats.py`` checks both by enumerating all 256
noise values for every bfloat16 value of a range of binades. ``formats.elements.round_to_element``
adds the noise exactly (no float32 rounding of the sum). A Triton kernel that takes the same bits
of ``tl.philox`` at the same counters draws bit-identical noise, which makes stochastic rounding
testable bit for bit and resumable from a checkpoint.

Considered and left: sharing one draw between the two orientations of dY (row-wise for dgrad,
column-wise for wgrad). Each element's rounding would stay unbiased, but the two quantized copies
of dY would no longer round independently, and the draw would have to be indexed by the element
rather than by its place in each orientation's storage, which the two kernels lay out differently.
"""

from __future__ import annotations

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10
WORDS_PER_CALL = 4
NOISE_BITS = 8
VALUES_PER_WORD = 32 // NOISE_BITS
VALUES_PER_CALL = WORDS_PER_CALL * VALUES_PER_WORD
# Versions of the noise layout (which bits of which call an element takes), recorded in checkpoints:
# a run resumed under another layout draws other noise from the same seeds.
NOISE_LAYOUTS = {
    1: "16 bits per element, 8 elements per Philox call (until 2026-12-05)",
    2: "8 bits per element, 16 elements per Philox call",
}
NOISE_LAYOUT = 2
_MASK32 = 0xFFFFFFFF
_NOISE_MASK = (1 << NOISE_BITS) - 1


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


def noise_bits(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``NOISE_BITS`` random bits (int64 in [0, 2**8)) per (non-negative) offset."""
    offsets = offsets.to(torch.int64)
    words = philox4x32(seed, offsets // VALUES_PER_CALL)
    word = (offsets // VALUES_PER_WORD) % WORDS_PER_CALL
    bits = words.gather(-1, word.unsqueeze(-1)).squeeze(-1)
    return (bits >> (NOISE_BITS * (offsets % VALUES_PER_WORD))) & _NOISE_MASK


def uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """float32 noise in [0, 1) on the ``2**-8`` grid, one value per (non-negative) offset."""
    return noise_bits(seed, offsets).to(torch.float32) * (2.0**-NOISE_BITS)


def noise_runs(seed: int, counters: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``noise_bits`` of the sixteen offsets ``16 * c + (0, ..., 15)`` of every call counter ``c``.

    The same bits as ``noise_bits`` for a fraction of its work: one Philox call per counter rather
    than per element, and the 64-bit product of each round taken in one int64 multiply (which
    wraps modulo 2**64, so its two words are exact) instead of four 16-bit partial products. Op
    count matters as much as bytes at these sizes, so the first round skips the product of the
    zero word, and the last round writes its four words side by side to be cut into bytes by a
    few ops over all of them. Returns int32 of ``counters``' shape with a new axis of size
    sixteen at ``dim``.
    """
    seed &= (1 << 64) - 1
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    keys = [((k0 + r * PHILOX_KEY_A) & _MASK32, (k1 + r * PHILOX_KEY_B) & _MASK32) for r in range(PHILOX_ROUNDS)]
    counters = counters.to(torch.int64)
    # Round 1 of (c0, c1, 0, 0): c2 * B = 0, so c0 <- c1 ^ k0 and c1 <- 0.
    p_a = (counters & _MASK32) * PHILOX_ROUND_A
    c0, c1 = (counters >> 32).bitwise_xor_(keys[0][0]), torch.zeros_like(counters)
    c2, c3 = (p_a >> 32).bitwise_xor_(keys[0][1]).bitwise_and_(_MASK32), p_a
    for key_a, key_b in keys[1:-1]:
        # c1 and c3 keep the full products: only their low words are ever read (by an xor
        # whose result is masked), so the mask is applied once, to the words that get multiplied.
        p_a, p_b = c0 * PHILOX_ROUND_A, c2 * PHILOX_ROUND_B
        c0 = (p_b >> 32).bitwise_xor_(c1).bitwise_xor_(key_a).bitwise_and_(_MASK32)
        c2 = (p_a >> 32).bitwise_xor_(c3).bitwise_xor_(key_b).bitwise_and_(_MASK32)
        c1, c3 = p_b, p_a
    words = torch.empty((WORDS_PER_CALL, *counters.shape), dtype=torch.int64, device=counters.device)
    torch.mul(c0, PHILOX_ROUND_A, out=words[3])
    torch.mul(c2, PHILOX_ROUND_B, out=words[1])
    # no masks: the int32 cast below keeps the low words
    torch.bitwise_right_shift(words[1], 32, out=words[0]).bitwise_xor_(c1).bitwise_xor_(keys[-1][0])
    torch.bitwise_right_shift(words[3], 32, out=words[2]).bitwise_xor_(c3).bitwise_xor_(keys[-1][1])
    dim = dim % (counters.dim() + 1)
    words = words.to(torch.int32).movedim(0, dim)
    out = torch.empty(
        (*words.shape[: dim + 1], VALUES_PER_WORD, *words.shape[dim + 1 :]), dtype=torch.int32, device=counters.device
    )
    for i in range(VALUES_PER_WORD):
        torch.bitwise_right_shift(words, NOISE_BITS * i, out=out.select(dim + 1, i)).bitwise_and_(_NOISE_MASK)
    return out.view(*counters.shape[:dim], VALUES_PER_CALL, *counters.shape[dim:])
