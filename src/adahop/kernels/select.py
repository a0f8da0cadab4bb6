"""Top-``k`` row selection for outlier extraction in one Triton program.

``torch.topk`` on a few thousand scores spends tens of microseconds in a single-block radix
select, and a training step calls it once per outlier-extracting GEMM. Here one program holds
all scores in registers and finds the ``k``-th largest by bisection on its bits (non-negative
float32 values order like their bit patterns as integers, NaN above +Inf), then writes the
chosen indices in ascending order: the rule of ``policy.selection.top_rows_reference``, bit for
bit, ties included. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..policy.selection import check_top_rows_args

MAX_ROWS = 1 << 16  # one program's registers: beyond this the caller sorts instead
# Bits of a score's float32 pattern below the sign that can be non-zero: a bfloat16 or float16
# score widened to float32 has zero low bits, so the bisection skips them (fewer reductions).
KEY_BITS = {torch.float32: 31, torch.bfloat16: 15, torch.float16: 18}


@triton.jit
def _top_rows_kernel(score_ptr, out_ptr, n, k, N_PAD: tl.constexpr, KEY_BITS: tl.constexpr):
    offs = tl.arange(0, N_PAD)
    valid = offs < n
    bits = tl.load(score_ptr + offs, mask=valid, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    key = tl.where(valid, bits & 0x7FFFFFFF, -1)  # |score|; padding below every score

    # The k-th largest key: the largest t with at least k keys >= t, one bit at a time.
    threshold = tl.zeros((), dtype=tl.int32)
    for i in tl.static_range(KEY_BITS):
        candidate = threshold | (1 << (30 - i))
        count = tl.sum((key >= candidate).to(tl.int32), axis=0)
        threshold = tl.where(count >= k, candidate, threshold)

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
    _top_rows_kernel[(1,)](
        scores.contiguous(), out, n, k, N_PAD=n_pad, KEY_BITS=KEY_BITS[scores.dtype], num_warps=num_warps
    )
    return out
