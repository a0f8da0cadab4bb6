"""Top-``k`` row selection for outlier extraction in one Triton program.

``torch.topk`` on a few thousand scores spends tens of microseconds in a single-block radix
select, and a training step calls it once per outlier-extracting GEMM. Here one program holds
all scores in registers and finds the ``k``-th largest by bisection on its bits (non-negative
float32 values order like their bit patterns as integers; every NaN gets one key above +Inf, so
NaNs tie as the rule says), then writes the chosen indices in ascending order: the rule of
``policy.selection.top_rows_reference``, bit for bit, ties included. Runs on CUDA, or on CPU
tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..policy.selection import check_top_rows_args

MAX_ROWS = 1 << 16  # one program's registers: beyond this the caller sorts instead
INF_KEY = tl.constexpr(0x7F800000)  # +Inf's float32 bits
NAN_KEY = tl.constexpr(0x7FC00000)  # every NaN's key: above +Inf, its low 22 bits zero
TOP_BIT = tl.constexpr(1 << 30)  # the highest bit below the sign


@triton.jit
def _top_rows_kernel(score_ptr, out_ptr, n, k, N_PAD: tl.constexpr):
    offs = tl.arange(0, N_PAD)
    valid = offs < n
    bits = tl.load(score_ptr + offs, mask=valid, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    key = bits & 0x7FFFFFFF  # |score|
    key = tl.where(key > INF_KEY, NAN_KEY, key)
    key = tl.where(valid, key, -1)  # padding below every score

    # The k-th largest key: the largest t with at least k keys >= t, one bit at a time, down to
    # the lowest bit any key sets (a bfloat16 or float16 score widened to float32, or a float32
    # one read from a 16-bit row, leaves the low bits of every key zero: fewer reductions).
    lowest = tl.min(tl.where(key > 0, key & -key, TOP_BIT), axis=0)
    threshold = tl.zeros((), dtype=tl.int32)
    bit = tl.full((), TOP_BIT, tl.int32)
    while bit >= lowest:
        candidate = threshold | bit
        count = tl.sum((key >= candidate).to(tl.int32), axis=0)
        threshold = tl.where(count >= k, candidate, threshold)
        bit = bit >> 1

    above = key > threshold
    tie = key == threshold
    ties_wanted = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_wanted))  # lowest indices first
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1  # ascending row order
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
    _top_rows_kernel[(1,)](scores.contiguous(), out, n, k, N_PAD=n_pad, num_warps=num_warps)
    return out
