"""The MXFP4 quantize kernels for the shapes training uses (block 32, no or a 32-point Hadamard):
row-wise (the forward and dgrad operands) and column-wise (the wgrad operands and dgrad's Wᵀ).
Both keep every block inside one thread, where the general kernel (``quantize_general.py``) lets
Triton spread a block over lanes and pays in shuffles and selects. ``kernels/quantize.py`` picks
and launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mx_math import (
    encode_e2m1_nearest,
    encode_elements,
    max_keeping_nan,
    philox_noise_runs,
    round_to_input_dtype,
    walsh_hadamard_butterfly,
)
from .quantize_blocks import block_scales, record_scores, row_blocks, row_word, slice_noise, to_float32


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    signs_ptr,
    data_ptr,
    scale_ptr,
    score_ptr,
    M,
    N,
    stride_m,
    n_padded,
    seed_ptr,
    hadamard_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
):
    """Row-wise MXFP4 (block 32, optional 32-point Hadamard): the forward and dgrad operands.

    The same arithmetic as ``quantize_tile``, laid out so that no value crosses a lane
    (``row_blocks``): the block maximum, the codes and the four 32-bit words (one 16-byte
    store) stay in the thread. The general kernel lets Triton spread a block over lanes and
    pays for it in shuffles and selects (``benchmarks/quantize/sass_counts.py`` counts them). Loading one
    coalesced tile and splitting it into slices instead makes Triton move them through shuffles
    again.
    """
    NB: tl.constexpr = BLOCK_N // 32
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score = row_blocks(
        x_ptr, signs_ptr, rows, blocks, M, N, stride_m, hadamard_scale, SPEC
    )
    if SPEC.scores:  # a row spans programs along N
        record_scores(score_ptr, rows, score, rows < M)

    store_row_words(
        v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, rows, blocks, M, n_padded, seed, data_ptr,
        scale_ptr, SPEC,
    )  # fmt: skip


@triton.jit
def store_row_words(
    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, rows, blocks, M, n_padded, seed, data_ptr, scale_ptr,
    SPEC: tl.constexpr,
):  # fmt: skip
    """Encode ``row_blocks``' outputs and store them as row-wise MXFP4: four 32-bit words per block (one
    16-byte store) and its E8M0 code, at ``rows`` and ``blocks`` of a [M, n_padded] operand."""
    BLOCK_M: tl.constexpr = rows.shape[0]
    NB: tl.constexpr = blocks.shape[0]
    # Word w of a row holds elements 8w..8w+7; Philox call c draws the noise of elements 16c..16c+15.
    n_blocks = n_padded // 32
    word0 = rows.to(tl.int64)[:, None] * (n_padded // 8) + (blocks * 4)[None, :]
    call0 = word0 // 2
    n0, n1 = slice_noise(seed, call0, SPEC)
    w0 = row_word(v0, inv_scale, limit, sign_weight, n0, SPEC)
    w1 = row_word(v1, inv_scale, limit, sign_weight, n1, SPEC)
    n2, n3 = slice_noise(seed, call0 + 1, SPEC)
    w2 = row_word(v2, inv_scale, limit, sign_weight, n2, SPEC)
    w3 = row_word(v3, inv_scale, limit, sign_weight, n3, SPEC)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_M, NB, 4])  # w0 w1 w2 w3
    ok = (rows < M)[:, None] & (blocks < n_blocks)[None, :]
    tl.store(data_ptr + word0[:, :, None] + tl.arange(0, 4)[None, None, :], words, mask=ok[:, :, None])

    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * n_blocks + blocks[None, :], scale_codes, mask=ok)


@triton.jit
def _quantize_cols_kernel(
    x_ptr,
    signs_ptr,
    data_ptr,
    scale_ptr,
    score_ptr,
    M,
    N,
    m_padded,
    seed_ptr,
    hadamard_scale,
    STRIDE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SPEC: tl.constexpr,
):
    """Column-wise MXFP4 (blocks of 32 down a column, optional 32-point Hadamard): the wgrad
    operands and dgrad's Wᵀ.

    A program takes one block of 32 rows and ``BLOCK_N`` columns as a [columns, rows] tile, one
    column per thread (``BLOCK_N`` = 32 x warps): a warp reads 64 contiguous bytes of a bf16 row,
    and each thread keeps its column's 32 values, so the butterfly, the block maximum and the
    packing of eight codes per word need no shuffles, and its four words leave in one 16-byte
    store without a pass through shared memory. Holding one column rather than two halves the
    live registers (the occupancy limit of this kernel). The row stride is a compile-time
    constant, so a thread's 32 loads share one address plus constant offsets, and ``MASKED`` is
    False where the tiles cover ``x`` exactly (M a multiple of 32, N of ``BLOCK_N``: every
    training shape), which drops the bounds checks.
    """
    seed = tl.load(seed_ptr)
    r0 = tl.program_id(0) * 32
    cols = tl.max_contiguous(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), 1)  # one per thread
    rows = tl.arange(0, 32)
    x_ptrs = x_ptr + r0.to(tl.int64) * STRIDE_M + cols[:, None] + (rows * STRIDE_M)[None, :]
    if MASKED:  # zero padding of a partial last block
        x = tl.load(x_ptrs, mask=(cols < N)[:, None] & (r0 + rows < M)[None, :], other=0)
    else:
        x = tl.load(x_ptrs)
    v = to_float32(x, SPEC.input_bf16)  # [BLOCK_N, 32]
    if SPEC.scores:  # a column (an output row) spans programs along M
        record_scores(score_ptr, cols, tl.reduce(tl.abs(v), 1, max_keeping_nan), cols < N)
    if SPEC.hadamard > 0:  # M is a multiple of 32: no padding inside a block
        if SPEC.has_signs:
            v = v * tl.load(signs_ptr + rows)[None, :]
        v = walsh_hadamard_butterfly(v, 5) * hadamard_scale
        ROUND_TO: tl.constexpr = SPEC.round_to
        v = round_to_input_dtype(v, ROUND_TO, SPEC.native_casts)  # hadamard_transform returns it

    amax = tl.reduce(tl.abs(v), 1, max_keeping_nan)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax.to(tl.int32, bitcast=True), amax < float("inf"), SPEC
    )
    scaled = v * inv_scale[:, None]
    limit, sign_weight = limit[:, None], sign_weight[:, None]
    # Word w of an output row (a column of x) holds its elements 8w..8w+7; Philox call c draws the
    # noise of elements 16c..16c+15.
    words = cols.to(tl.int64)[:, None] * (m_padded // 8) + (r0 // 8 + tl.arange(0, 4))[None, :]
    if SPEC.stochastic:
        noise = philox_noise_runs(
            seed, cols.to(tl.int64)[:, None] * (m_padded // 16) + (r0 // 16 + tl.arange(0, 2))[None, :]
        )
        codes = encode_elements(scaled, noise, limit, sign_weight, True, SPEC.mbits, SPEC.emin)
    else:
        codes = encode_e2m1_nearest(scaled, limit, sign_weight)
    packed = tl.sum(tl.reshape(codes, [BLOCK_N, 4, 8]) << (tl.arange(0, 8) * 4)[None, None, :], axis=2)
    scale_offs = cols.to(tl.int64) * (m_padded // 32) + r0 // 32
    if MASKED:
        tl.store(data_ptr + words, packed, mask=(cols < N)[:, None])
        tl.store(scale_ptr + scale_offs, scale_codes, mask=cols < N)
    else:
        tl.store(data_ptr + words, packed)
        tl.store(scale_ptr + scale_offs, scale_codes)
