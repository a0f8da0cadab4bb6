"""Top-``k`` row selection for outlier extraction in one Triton program.

``torch.topk`` on a few thousand scores spends tens of microseconds in a single-block radix
select, and a training step calls it once per outlier-extracting GEMM. Here one program holds
all scores in registers and finds the ``k``-th largest by a radix select on their bits, a few
bits a pass (non-negative float32 values order like their bit patterns as integers; every NaN
gets one key above +Inf, so NaNs tie as the rule says), then writes the chosen indices in
ascending order: the rule of ``policy.selection.top_rows_reference``, bit for bit, ties
included. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..policy.selection import check_top_rows_args

MAX_ROWS = 1 << 16  # one program's registers: beyond this the caller sorts instead
INF_KEY = tl.constexpr(0x7F800000)  # +Inf's float32 bits
NAN_KEY = tl.constexpr(0x7FC00000)  # every NaN's key: above +Inf, its low 22 bits zero
DIGIT_BITS = 5  # key bits a pass settles: 32 bins, one a lane in the histogram (fewest instructions; select_sm90.py)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _floor_log2(x):
    """The index of ``x``'s highest set bit (0 < x < 2**31), from a float32 exponent: ``x >> 7``
    has at most 24 significant bits, so the conversion is exact and cannot round up a binade."""
    wide = x >= 128
    exponent = (tl.where(wide, x >> 7, x).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    return tl.where(wide, exponent + 7, exponent)


@triton.jit
def _top_rows_kernel(score_ptr, out_ptr, n, k, N_PAD: tl.constexpr, DIGIT_BITS: tl.constexpr):
    offs = tl.arange(0, N_PAD)
    valid = offs < n
    bits = tl.load(score_ptr + offs, mask=valid, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    key = bits & 0x7FFFFFFF  # |score|
    key = tl.where(key > INF_KEY, NAN_KEY, key)
    key = tl.where(valid, key, -1)  # padding below every score

    # The k-th largest key by a radix select: each pass counts one digit of DIGIT_BITS bits among
    # the keys that share the digits settled so far (one histogram), then settles the largest digit
    # with at least k keys at or above it. Digits run from the highest bit any key sets down to the
    # lowest (a bfloat16 or float16 score widened to float32, or a float32 one read from a 16-bit
    # row, leaves the low bits of every key zero: fewer passes).
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    set_bits = tl.reduce(tl.maximum(key, 0), 0, _bit_or)
    low = tl.maximum(_floor_log2(set_bits & -set_bits), 0)  # all keys zero: one pass at bit 0
    high = tl.maximum(_floor_log2(set_bits), 0)
    shift = low + (high - low) // DIGIT_BITS * DIGIT_BITS
    prefix = tl.zeros((), dtype=tl.int32)  # the settled digits; those below `shift` still zero
    above = tl.zeros((), dtype=tl.int32)  # keys above every key with this prefix
    bins = tl.arange(0, RADIX)
    while shift >= low:
        rest = (key ^ prefix) >> shift  # the digit where the settled digits match, else >= RADIX
        counts = tl.histogram(rest & (RADIX - 1), RADIX, mask=rest.to(tl.uint32, bitcast=True) < RADIX)
        at_or_above = above + tl.cumsum(counts, axis=0, reverse=True)  # keys >= each digit
        digit = tl.sum((at_or_above >= k).to(tl.int32), axis=0) - 1  # at_or_above never grows
        above += tl.sum(tl.where(bins > digit, counts, 0), axis=0)
        prefix |= digit << shift
        shift -= DIGIT_BITS

    # `prefix` is the k-th largest key and `above` counts the keys above it; the ties it needs
    # go to the lowest indices. A row's slot counts the taken rows up to it, ascending: the rows
    # above up to it, plus its ties up to it while fewer than wanted (one scan of both counts).
    over = key > prefix
    tie = key == prefix
    ties_wanted = k - above
    if N_PAD <= (1 << 15):  # both counts fit 16 bits: one scan of both
        both = tl.cumsum(over.to(tl.int32) | (tie.to(tl.int32) << 16), axis=0)
        over_before = both & 0xFFFF
        ties_before = (both >> 16) & 0xFFFF
    else:
        over_before = tl.cumsum(over.to(tl.int32), axis=0)
        ties_before = tl.cumsum(tie.to(tl.int32), axis=0)
    take = over | (tie & (ties_before <= ties_wanted))
    slot = over_before + tl.minimum(ties_before, ties_wanted) - 1
    tl.store(out_ptr + slot, offs.to(tl.int64), mask=take)


def top_rows_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``top_rows_reference(scores, k)`` for up to ``MAX_ROWS`` scores, in one launch."""
    check_top_rows_args(scores, k)
    n = scores.numel()
    if n > MAX_ROWS:
        raise ValueError(f"top_rows_triton takes at most {MAX_ROWS} scores, got {n}")
    out = torch.empty(k, dtype=torch.int64, device=scores.device)
    n_pad = triton.next_power_of_2(n)
    num_warps = 4 if n_pad <= 2048 else 8 if n_pad <= 8192 else 16
    _top_rows_kernel[(1,)](scores.contiguous(), out, n, k, N_PAD=n_pad, DIGIT_BITS=DIGIT_BITS, num_warps=num_warps)
    return out
