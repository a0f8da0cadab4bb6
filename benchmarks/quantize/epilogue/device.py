"""Triton device functions both epilogue kernels use: the row-wise slice layout of
``adahop.kernels.quantize_blocks.row_blocks`` (four 8-wide slices per block of 32, one block per
thread) and the bf16 rounding of a computed value into the bits the quantizer takes."""

from __future__ import annotations

import triton
import triton.language as tl

from adahop.kernels.mx_math import round_to_bf16
from adahop.kernels.quantize_blocks import slice_blocks
from adahop.kernels.quantize_fold import store_folded_rows


@triton.jit
def slice_offsets(rows, blocks, M, N, stride_m, k: tl.constexpr):
    """Offsets and mask of slice ``k`` (elements 8k..8k+7 of each block, [R, NB, 8]) of ``rows``:
    rows past M and columns past N masked off (loaded as zeros, the padding of a partial tile)."""
    cols = (blocks * 32 + 8 * k)[None, :, None] + tl.arange(0, 8)[None, None, :]
    offs = (rows.to(tl.int64) * stride_m)[:, None, None] + cols
    return offs, (rows < M)[:, None, None] & (cols < N)


@triton.jit
def bf16_value(bits):
    """The float32 value of bf16 ``bits`` (int16): exact, a shift of the bits."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(v, NATIVE: tl.constexpr):
    """float32 ``v`` rounded to bfloat16 (to nearest, ties to even), as int16 bits: the hardware
    conversion on the GPU (a NaN becomes 0x7FFF, as in eager CUDA), the bit rounding of
    ``mx_math.round_to_bf16`` in the interpreter, whose casts truncate."""
    if NATIVE:
        return v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    rounded = round_to_bf16(v, False).to(tl.uint32, bitcast=True)
    return (rounded >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def quantize_fold_slices(
    x0, x1, x2, x3, rows, blocks, M, N, seed, signs_ptr, hadamard_scale,
    out_ptr, row_scale_ptr, lossy_ptr, score_ptr, SPEC: tl.constexpr,
):  # fmt: skip
    """``quantize_fold_fp8``'s work on four computed slices (bf16 bits, +0 past the row's end) of whole
    rows: its own device functions, so the fused kernels write exactly what it writes."""
    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score = slice_blocks(
        x0, x1, x2, x3, signs_ptr, hadamard_scale, SPEC
    )
    store_folded_rows(
        v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score,
        rows, blocks, M, N, seed, out_ptr, row_scale_ptr, lossy_ptr, score_ptr, SPEC,
    )  # fmt: skip
