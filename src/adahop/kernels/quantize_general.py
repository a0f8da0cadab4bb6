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
    SCORES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    ROUND_TO: tl.constexpr,
    NATIVE_CASTS: tl.constexpr,
    HADAMARD: tl.constexpr,
    HADAMARD_STAGES: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RULE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EMAX: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_CODE: tl.constexpr,
    ELEMENT_BITS: tl.constexpr,
    CODES_PER_UNIT: tl.constexpr,
):
    seed = tl.load(seed_ptr)
    row_start = tl.program_id(0) * BLOCK_M
    col_start = tl.program_id(1) * BLOCK_N
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_n
    x = tl.load(x_ptr + offs, mask=mask, other=0)  # zero padding of partial blocks
    if SCORES:  # one orientation: each line's abs-max along its blocks, before the Hadamard
        magnitude = tl.abs(to_float32(x, INPUT_BF16))
        if ROWWISE:
            record_scores(score_ptr, rows, tl.reduce(magnitude, 1, max_keeping_nan), rows < M)
        else:
            record_scores(score_ptr, cols, tl.reduce(magnitude, 0, max_keeping_nan), cols < N)

    # Triton's compiler takes keyword arguments but no ``**`` unpacking: each call spells them out.
    if ROWWISE:
        quantize_tile(
            to_float32(x, INPUT_BF16),
            row_start=row_start,
            col_start=col_start,
            n_rows=M,
            length=N,
            padded_len=n_padded,
            data_ptr=row_data_ptr,
            scale_ptr=row_scale_ptr,
            signs_ptr=signs_ptr,
            seed=seed,
            hadamard_scale=hadamard_scale,
            ROUND_TO=ROUND_TO,
            NATIVE_CASTS=NATIVE_CASTS,
            HADAMARD=HADAMARD,
            HADAMARD_STAGES=HADAMARD_STAGES,
            HAS_SIGNS=HAS_SIGNS,
            BLOCK_SIZE=BLOCK_SIZE,
            RULE=RULE,
            STOCHASTIC=STOCHASTIC,
            EMAX=EMAX,
            EMIN=EMIN,
            MBITS=MBITS,
            MAX_NORMAL=MAX_NORMAL,
            MAX_CODE=MAX_CODE,
            ELEMENT_BITS=ELEMENT_BITS,
            CODES_PER_UNIT=CODES_PER_UNIT,
        )
    if COLWISE:  # the transposed tile (the raw input: half the bytes to move for 16-bit inputs)
        quantize_tile(
            to_float32(tl.trans(x), INPUT_BF16),
            row_start=col_start,
            col_start=row_start,
            n_rows=N,
            length=M,
            padded_len=m_padded,
            data_ptr=col_data_ptr,
            scale_ptr=col_scale_ptr,
            signs_ptr=signs_ptr,
            seed=seed,
            hadamard_scale=hadamard_scale,
            ROUND_TO=ROUND_TO,
            NATIVE_CASTS=NATIVE_CASTS,
            HADAMARD=HADAMARD,
            HADAMARD_STAGES=HADAMARD_STAGES,
            HAS_SIGNS=HAS_SIGNS,
            BLOCK_SIZE=BLOCK_SIZE,
            RULE=RULE,
            STOCHASTIC=STOCHASTIC,
            EMAX=EMAX,
            EMIN=EMIN,
            MBITS=MBITS,
            MAX_NORMAL=MAX_NORMAL,
            MAX_CODE=MAX_CODE,
            ELEMENT_BITS=ELEMENT_BITS,
            CODES_PER_UNIT=CODES_PER_UNIT,
        )
