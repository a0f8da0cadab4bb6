"""The general quantize kernel: any format, block size and Hadamard size, either or both
orientations from one read of a ``[BLOCK_M, BLOCK_N]`` tile (``quantize_blocks.quantize_tile``
does each orientation's arithmetic). ``kernels/quantize.py`` picks it where the MXFP4 kernels of
``quantize_mxfp4.py`` do not apply, and launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mx_math import max_keeping_nan
from .quantize_blocks import quantize_tile, record_scores, to_float32


@triton.jit
def _quantize_mx_kernel(
    x_ptr,
    signs_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    score_ptr,
    M,
    N,
    stride_m,
    stride_n,
    m_padded,
    n_padded,
    seed_ptr,
    hadamard_scale,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
):
    seed = tl.load(seed_ptr)
    row_start = tl.program_id(0) * BLOCK_M
    col_start = tl.program_id(1) * BLOCK_N
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_n
    x = tl.load(x_ptr + offs, mask=mask, other=0)  # zero padding of partial blocks
    if SPEC.scores:  # one orientation: each line's abs-max along its blocks, before the Hadamard
        magnitude = tl.abs(to_float32(x, SPEC.input_bf16))
        if ROWWISE:
            record_scores(score_ptr, rows, tl.reduce(magnitude, 1, max_keeping_nan), rows < M)
        else:
            record_scores(score_ptr, cols, tl.reduce(magnitude, 0, max_keeping_nan), cols < N)

    # quantize_tile(tile, first output row, first block-axis column, output rows, block-axis length,
    # its padded length, codes, scales, ...): the columns of the transposed tile are x's rows.
    if ROWWISE:
        v = to_float32(x, SPEC.input_bf16)
        quantize_tile(
            v, row_start, col_start, M, N, n_padded, row_data_ptr, row_scale_ptr, signs_ptr, seed, hadamard_scale, SPEC
        )
    if COLWISE:  # the transposed tile (the raw input: half the bytes to move for 16-bit inputs)
        v = to_float32(tl.trans(x), SPEC.input_bf16)
        quantize_tile(
            v, col_start, row_start, N, M, m_padded, col_data_ptr, col_scale_ptr, signs_ptr, seed, hadamard_scale, SPEC
        )
