"""Fused (Hadamard +) MX quantization: one read of a 2-D tensor, packed codes and E8M0 scales out.

``quantize_mx_triton(x, ...)`` equals, bit for bit,
``quantize_mx(hadamard_transform(x, axis=axis, block_size=hb, signs=signs) if hb else x, ...)``
for every format, scale rule and rounding mode, with stochastic-rounding noise drawn from the
same Philox stream (``formats.philox``) at the same offsets. ``quantize_mx_triton_both`` writes
the row-wise copy (blocks along ``in``, for the forward GEMM) and the column-wise copy (blocks
along tokens, for wgrad/dgrad) from a single read.

Hadamard decision: the transform runs as a fixed-order butterfly (``log2(hb)`` add/subtract
stages on float32, then one multiply by ``1/sqrt(hb)``), and ``hadamard_transform`` is defined
by the same butterfly, so the two agree bit for bit on every device. A ``tl.dot`` against ``H``
sums in an order set by the tensor cores and could only match to an ulp or two, flipping codes.
Kernels. ``_quantize_mx_kernel`` is the general one (any format, block size, Hadamard size,
both orientations from one read). Two MXFP4 kernels for the shapes training uses keep every
block inside one thread: ``_quantize_rows_h32_kernel`` (row-wise, 32-point Hadamard) and
``_quantize_cols_kernel`` (column-wise, with or without it); in the general kernel Triton
spreads a block over lanes and pays in shuffles and selects.
Cost. On sm_90 quantization is bound by the instructions it issues (the integer-logic pipe,
16 lanes per scheduler, most of all), not by memory, so: E2M1 rounding to nearest is the
minimum of three FMA-rounded lines (``mx_math.encode_e2m1_nearest``); stochastic rounding
takes 16 noise bits per element, eight elements per Philox4x32-10 call, added in fixed point;
block maxima are float maxima that keep NaN. ``benchmarks/sass_counts.py`` prints the static
instruction counts per element; on the H200 (``benchmarks/results/``) the row-wise RN kernel
reaches 0.78 of copy bandwidth at 16384x4096.

The tensor is processed in ``[block_m, block_n]`` tiles; a tile's block axis holds whole MX
blocks and whole Hadamard blocks. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats.elements import ElementFormat, encode_e2m1, encode_fp8
from ..formats.mx import ELEMENT_FORMATS, MXTensor, check_quantize_args, storage_shapes
from ..transforms.hadamard import check_hadamard_args
from .mx_math import (
    E8M0_NAN,
    F32_BIAS,
    bf16_bits_to_float,
    encode_e2m1_nearest,
    encode_elements,
    F32_INF_BITS,
    exp2_int,
    max_keeping_nan,
    pack_codes,
    philox_noise,
    philox_noise_runs,
    round_to_input_dtype,
    shared_exponent,
    walsh_hadamard_butterfly,
)
from .mx_triton import cdiv

MAX_WARPS = 32  # 1024 threads, the most a CUDA block can hold


@dataclass(frozen=True)
class QuantizeTiling:
    """Tile shape and warps of one program; both tile sides are powers of two."""

    block_m: int = 32
    block_n: int = 128
    num_warps: int = 4

    def fit(self, min_m: int, min_n: int) -> QuantizeTiling:
        """This tiling grown to at least ``min_m x min_n`` (whole MX and Hadamard blocks).

        The other side shrinks to keep the elements per thread (and so the registers) of the
        configured tile; warps are added only when both sides must grow.
        """
        area = self.block_m * self.block_n
        block_m = max(min_m, area // max(self.block_n, min_n))
        block_n = max(min_n, area // block_m)
        num_warps = min(self.num_warps * block_m * block_n // area, MAX_WARPS)
        return QuantizeTiling(block_m, block_n, num_warps)


# The interpreter pays milliseconds per program: give each one a large tile.
INTERPRETER_TILING = QuantizeTiling(block_m=128, block_n=256, num_warps=1)
# Per orientation and Hadamard, the tiling with the least round-to-nearest plus stochastic time in
# the H200 sweep benchmarks/results/2026-12-03-h200-quantize-sweep.json (the top few of each case
# are within 1-3%, the run-to-run noise).
# Row-wise MXFP4 (block 32) with a Hadamard or stochastic rounding and column-wise MXFP4 run their
# own kernels, which keep whole blocks in a thread; the column-wise one reads ``block_n`` columns
# of one block of 32 rows.
CUDA_TILINGS = {
    ("rowwise", False): QuantizeTiling(block_m=16, block_n=128, num_warps=1),
    ("rowwise", True): QuantizeTiling(block_m=8, block_n=256, num_warps=2),
    ("colwise", False): QuantizeTiling(block_m=32, block_n=128, num_warps=2),
    ("colwise", True): QuantizeTiling(block_m=32, block_n=128, num_warps=2),
    ("both", False): QuantizeTiling(block_m=16, block_n=128, num_warps=1),
    ("both", True): QuantizeTiling(block_m=32, block_n=128, num_warps=4),
}
# Column-wise cases the general kernel serves (other formats and block sizes): a block must not
# span warps (Triton lays warps along a tile's rows and reduces across them through shared
# memory, 4x slower on the H200), so the tile takes one warp.
GENERAL_COLWISE_TILING = QuantizeTiling(block_m=32, block_n=64, num_warps=1)


def default_tiling(orientation: str, device: torch.device, hadamard: bool = False) -> QuantizeTiling:
    """The tiling ``quantize_mx_triton`` uses for ``orientation`` ("rowwise", "colwise", "both")."""
    return CUDA_TILINGS[orientation, hadamard] if device.type == "cuda" else INTERPRETER_TILING


@triton.jit
def block_scales(amax_bits, finite, RULE: tl.constexpr, EMAX: tl.constexpr, MAX_NORMAL: tl.constexpr,
                  MBITS: tl.constexpr, MAX_CODE: tl.constexpr, ELEMENT_BITS: tl.constexpr):
    """Per block, from its maximum's float32 bits: ``2**-s`` (s <= 126 for every finite amax, so a
    normal number), the code limit and the sign weight (both 0 for a NaN/Inf block, whose element
    codes become 0) and the E8M0 code (255 for NaN/Inf)."""
    s = shared_exponent(amax_bits, RULE, EMAX, MAX_NORMAL, MBITS)
    limit = tl.where(finite, MAX_CODE, 0).to(tl.uint32)
    sign_weight = tl.where(finite, 1 << (ELEMENT_BITS - 1), 0).to(tl.uint32)
    scale_code = tl.where(finite, s + F32_BIAS, E8M0_NAN).to(tl.uint8)
    return exp2_int(-s), limit, sign_weight, scale_code


@triton.jit
def _quantize_tile(
    v, row_start, col_start, n_rows, length, padded_len,
    data_ptr, scale_ptr, signs_ptr, seed, hadamard_scale,
    ROUND_TO: tl.constexpr, NATIVE_CASTS: tl.constexpr, HADAMARD: tl.constexpr,
    HADAMARD_STAGES: tl.constexpr, HAS_SIGNS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
    MBITS: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_CODE: tl.constexpr,
    ELEMENT_BITS: tl.constexpr, CODES_PER_UNIT: tl.constexpr,
):
    """Quantize float32 tile ``v`` [R, C] with blocks along its last axis and store it.

    Rows are ``row_start + i`` of the output, columns ``col_start + j`` of its block axis
    (``length`` valid, ``padded_len`` stored). ``data_ptr`` points to units (uint8 or uint32)
    of ``CODES_PER_UNIT`` packed codes.
    """
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    rows = row_start + tl.arange(0, R)
    cols = col_start + tl.arange(0, C)

    if HADAMARD > 0:
        groups = tl.reshape(v, [R * C // HADAMARD, HADAMARD])
        if HAS_SIGNS:
            groups = groups * tl.load(signs_ptr + tl.arange(0, HADAMARD))[None, :]
        groups = walsh_hadamard_butterfly(groups, HADAMARD_STAGES) * hadamard_scale
        v = tl.reshape(groups, [R, C])
        v = round_to_input_dtype(v, ROUND_TO, NATIVE_CASTS)  # hadamard_transform returns it
        v = tl.where(cols[None, :] < length, v, 0.0)  # padding is +0, as in the reference

    blocks = tl.reshape(v, [R, C // BLOCK_SIZE, BLOCK_SIZE])
    if HADAMARD > 0:
        # The butterfly leaves a block spread over lanes: an integer max reduces across a warp
        # in one instruction (REDUX). |v| << 1 orders like |v| as unsigned, NaN above Inf.
        amax2 = tl.max(blocks.to(tl.uint32, bitcast=True) << 1, axis=2)
        finite = amax2 < (F32_INF_BITS << 1)
        amax_bits = (amax2 >> 1).to(tl.int32)
    else:  # a block sits in few lanes: one float max (|.| is free) per element
        amax = tl.reduce(tl.abs(blocks), 2, max_keeping_nan)
        finite = amax < float("inf")
        amax_bits = amax.to(tl.int32, bitcast=True)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax_bits, finite, RULE, EMAX, MAX_NORMAL, MBITS, MAX_CODE, ELEMENT_BITS
    )
    scaled = blocks * inv_scale[:, :, None]
    limit, sign_weight = limit[:, :, None], sign_weight[:, :, None]
    if STOCHASTIC:
        row_offsets = rows.to(tl.int64) * padded_len
        if BLOCK_SIZE % 8 == 0:  # runs of eight elements share a Philox call
            runs = (col_start + tl.arange(0, C // 8) * 8) // 8
            noise = philox_noise_runs(seed, row_offsets[:, None] // 8 + runs[None, :])
        else:
            noise = philox_noise(seed, row_offsets[:, None] + cols[None, :])
        noise = tl.reshape(noise, [R, C // BLOCK_SIZE, BLOCK_SIZE])
        codes = encode_elements(scaled, noise, limit, sign_weight, True, MBITS, EMIN)
    elif ELEMENT_BITS == 4:
        codes = encode_e2m1_nearest(scaled, limit, sign_weight)
    else:
        codes = encode_elements(scaled, 0, limit, sign_weight, False, MBITS, EMIN)
    units = pack_codes(tl.reshape(codes, [R, C]), ELEMENT_BITS, CODES_PER_UNIT)

    row_ok = rows[:, None] < n_rows
    UNITS: tl.constexpr = C // CODES_PER_UNIT
    unit_cols = col_start // CODES_PER_UNIT + tl.arange(0, UNITS)
    row_units = padded_len // CODES_PER_UNIT
    unit_offs = rows[:, None].to(tl.int64) * row_units + unit_cols[None, :]
    tl.store(data_ptr + unit_offs, units, mask=row_ok & (unit_cols[None, :] < row_units))

    n_blocks = padded_len // BLOCK_SIZE
    block_cols = col_start // BLOCK_SIZE + tl.arange(0, C // BLOCK_SIZE)
    scale_offs = rows[:, None].to(tl.int64) * n_blocks + block_cols[None, :]
    tl.store(scale_ptr + scale_offs, scale_codes, mask=row_ok & (block_cols[None, :] < n_blocks))


@triton.jit
def _to_float32(x, INPUT_BF16: tl.constexpr):
    if INPUT_BF16:
        return bf16_bits_to_float(x)
    return x.to(tl.float32)


@triton.jit
def _quantize_mx_kernel(
    x_ptr, signs_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    M, N, stride_m, stride_n, m_padded, n_padded, seed_ptr, hadamard_scale,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_BF16: tl.constexpr, ROUND_TO: tl.constexpr, NATIVE_CASTS: tl.constexpr,
    HADAMARD: tl.constexpr, HADAMARD_STAGES: tl.constexpr, HAS_SIGNS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
    MBITS: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_CODE: tl.constexpr,
    ELEMENT_BITS: tl.constexpr, CODES_PER_UNIT: tl.constexpr,
):
    seed = tl.load(seed_ptr)
    row_start = tl.program_id(0) * BLOCK_M
    col_start = tl.program_id(1) * BLOCK_N
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_n
    x = tl.load(x_ptr + offs, mask=mask, other=0)  # zero padding of partial blocks

    if ROWWISE:
        _quantize_tile(
            _to_float32(x, INPUT_BF16), row_start, col_start, M, N, n_padded, row_data_ptr,
            row_scale_ptr, signs_ptr, seed, hadamard_scale, ROUND_TO, NATIVE_CASTS, HADAMARD,
            HADAMARD_STAGES, HAS_SIGNS, BLOCK_SIZE, RULE, STOCHASTIC, EMAX, EMIN, MBITS,
            MAX_NORMAL, MAX_CODE, ELEMENT_BITS, CODES_PER_UNIT,
        )
    if COLWISE:  # the transposed tile (the raw input: half the bytes to move for 16-bit inputs)
        _quantize_tile(
            _to_float32(tl.trans(x), INPUT_BF16), col_start, row_start, N, M, m_padded,
            col_data_ptr, col_scale_ptr, signs_ptr, seed, hadamard_scale, ROUND_TO,
            NATIVE_CASTS, HADAMARD, HADAMARD_STAGES, HAS_SIGNS, BLOCK_SIZE, RULE, STOCHASTIC,
            EMAX, EMIN, MBITS, MAX_NORMAL, MAX_CODE, ELEMENT_BITS, CODES_PER_UNIT,
        )


@triton.jit
def row_slice(x, signs_ptr, k: tl.constexpr, HADAMARD: tl.constexpr, INPUT_BF16: tl.constexpr,
               HAS_SIGNS: tl.constexpr):
    """Slice ``k`` (elements 8k..8k+7 of each block, [R, NB, 8]) as float32, after butterfly
    stages 1, 2, 4 when ``HADAMARD``."""
    R: tl.constexpr = x.shape[0]
    NB: tl.constexpr = x.shape[1]
    v = _to_float32(x, INPUT_BF16)
    if HADAMARD > 0:
        if HAS_SIGNS:
            v = v * tl.load(signs_ptr + 8 * k + tl.arange(0, 8))[None, None, :]
        v = tl.reshape(walsh_hadamard_butterfly(tl.reshape(v, [R * NB, 8]), 3), [R, NB, 8])
    return v


@triton.jit
def h32_finish(v, hadamard_scale, ROUND_TO: tl.constexpr, NATIVE_CASTS: tl.constexpr):
    """Normalise a transformed slice and round it to the input dtype, as the reference does.

    No padding to zero: a Hadamard needs a row length that is a multiple of 32, so a block is
    either whole or wholly outside the row (loaded as zeros, never stored).
    """
    v = v * hadamard_scale
    v = round_to_input_dtype(v, ROUND_TO, NATIVE_CASTS)  # hadamard_transform returns it
    return v


@triton.jit
def row_blocks(x_ptr, signs_ptr, rows, blocks, M, N, stride_m, hadamard_scale,
               HADAMARD: tl.constexpr, INPUT_BF16: tl.constexpr, ROUND_TO: tl.constexpr,
               NATIVE_CASTS: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr, EMAX: tl.constexpr,
               MAX_NORMAL: tl.constexpr, MBITS: tl.constexpr, MAX_CODE: tl.constexpr):
    """Blocks ``blocks`` of ``rows`` as four float32 slices [R, NB, 8] (elements 8k..8k+7 of each
    block, after the 32-point Hadamard when ``HADAMARD``), with each block's inverse scale, code
    limit and sign weight ([R, NB, 1]) and E8M0 code ([R, NB]).

    Each block is loaded as four 8-wide slices (16-byte loads for bf16) that share one register
    layout, so butterfly stages 1, 2, 4 run inside a slice and stages 8, 16 between slices, in
    the reference's order, and the block maximum stays in the thread.
    """
    cols = (blocks * 32)[None, :, None] + tl.arange(0, 8)[None, None, :]  # slice 0 of each block
    offs = (rows.to(tl.int64) * stride_m)[:, None, None] + cols
    row_ok = (rows < M)[:, None, None]  # columns past N load as zeros: the padding of a partial block
    v0 = row_slice(tl.load(x_ptr + offs, mask=row_ok & (cols < N), other=0), signs_ptr, 0, HADAMARD, INPUT_BF16, HAS_SIGNS)
    v1 = row_slice(tl.load(x_ptr + offs + 8, mask=row_ok & (cols + 8 < N), other=0), signs_ptr, 1, HADAMARD, INPUT_BF16, HAS_SIGNS)
    v2 = row_slice(tl.load(x_ptr + offs + 16, mask=row_ok & (cols + 16 < N), other=0), signs_ptr, 2, HADAMARD, INPUT_BF16, HAS_SIGNS)
    v3 = row_slice(tl.load(x_ptr + offs + 24, mask=row_ok & (cols + 24 < N), other=0), signs_ptr, 3, HADAMARD, INPUT_BF16, HAS_SIGNS)
    if HADAMARD > 0:
        # Stage 8 pairs slices (0, 1) and (2, 3); stage 16 pairs (0, 2) and (1, 3).
        a0, a1, a2, a3 = v0 + v1, v0 - v1, v2 + v3, v2 - v3
        v0 = h32_finish(a0 + a2, hadamard_scale, ROUND_TO, NATIVE_CASTS)
        v1 = h32_finish(a1 + a3, hadamard_scale, ROUND_TO, NATIVE_CASTS)
        v2 = h32_finish(a0 - a2, hadamard_scale, ROUND_TO, NATIVE_CASTS)
        v3 = h32_finish(a1 - a3, hadamard_scale, ROUND_TO, NATIVE_CASTS)

    amax = max_keeping_nan(max_keeping_nan(tl.abs(v0), tl.abs(v1)), max_keeping_nan(tl.abs(v2), tl.abs(v3)))
    amax = tl.reduce(amax, 2, max_keeping_nan)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax.to(tl.int32, bitcast=True), amax < float("inf"), RULE, EMAX, MAX_NORMAL, MBITS, MAX_CODE, 4
    )
    return (v0, v1, v2, v3, inv_scale[:, :, None], limit[:, :, None], sign_weight[:, :, None], scale_codes)


@triton.jit
def row_codes(v, inv_scale, limit, sign_weight, counters, seed,
              STOCHASTIC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """E2M1 codes of a slice ([R, NB, 8], block scale applied here); ``counters`` [R, NB] are
    its Philox counters (the index of its 32-bit word in the packed row)."""
    R: tl.constexpr = v.shape[0]
    NB: tl.constexpr = v.shape[1]
    scaled = v * inv_scale
    if STOCHASTIC:
        noise = tl.reshape(philox_noise_runs(seed, counters), [R, NB, 8])
        return encode_elements(scaled, noise, limit, sign_weight, True, MBITS, EMIN)
    return encode_e2m1_nearest(scaled, limit, sign_weight)


@triton.jit
def _row_word(v, inv_scale, limit, sign_weight, counters, seed,
              STOCHASTIC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """A slice's 8 codes packed into one 32-bit word per block, first code lowest."""
    codes = row_codes(v, inv_scale, limit, sign_weight, counters, seed, STOCHASTIC, MBITS, EMIN)
    return tl.sum(codes << (tl.arange(0, 8) * 4)[None, None, :], axis=2)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, signs_ptr, data_ptr, scale_ptr, M, N, stride_m, n_padded, seed_ptr, hadamard_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HADAMARD: tl.constexpr, INPUT_BF16: tl.constexpr,
    ROUND_TO: tl.constexpr, NATIVE_CASTS: tl.constexpr, HAS_SIGNS: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
    MBITS: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_CODE: tl.constexpr,
):
    """Row-wise MXFP4 (block 32, optional 32-point Hadamard): the forward and dgrad operands.

    The same arithmetic as ``_quantize_tile``, laid out so that no value crosses a lane
    (``row_blocks``): the block maximum, the codes and the four 32-bit words (one 16-byte
    store) stay in the thread. The general kernel lets Triton spread a block over lanes and
    pays for it in shuffles and selects (sm_90 instructions per element, bf16 in: 50 -> 24
    round-to-nearest, 63 -> 37 stochastic). Loading one coalesced tile and splitting it into
    slices instead makes Triton move them through shuffles again (45).
    """
    NB: tl.constexpr = BLOCK_N // 32
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes = row_blocks(
        x_ptr, signs_ptr, rows, blocks, M, N, stride_m, hadamard_scale, HADAMARD, INPUT_BF16, ROUND_TO,
        NATIVE_CASTS, HAS_SIGNS, RULE, EMAX, MAX_NORMAL, MBITS, MAX_CODE,
    )

    # Word w of a row holds elements 8w..8w+7; its index is also their Philox counter.
    n_blocks = n_padded // 32
    word0 = rows.to(tl.int64)[:, None] * (n_padded // 8) + (blocks * 4)[None, :]
    w0 = _row_word(v0, inv_scale, limit, sign_weight, word0, seed, STOCHASTIC, MBITS, EMIN)
    w1 = _row_word(v1, inv_scale, limit, sign_weight, word0 + 1, seed, STOCHASTIC, MBITS, EMIN)
    w2 = _row_word(v2, inv_scale, limit, sign_weight, word0 + 2, seed, STOCHASTIC, MBITS, EMIN)
    w3 = _row_word(v3, inv_scale, limit, sign_weight, word0 + 3, seed, STOCHASTIC, MBITS, EMIN)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_M, NB, 4])  # w0 w1 w2 w3
    ok = ((rows < M)[:, None] & (blocks < n_blocks)[None, :])
    tl.store(data_ptr + word0[:, :, None] + tl.arange(0, 4)[None, None, :], words, mask=ok[:, :, None])

    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * n_blocks + blocks[None, :], scale_codes, mask=ok)


@triton.jit
def _quantize_cols_kernel(
    x_ptr, signs_ptr, data_ptr, scale_ptr, M, N, stride_m, m_padded, seed_ptr, hadamard_scale,
    BLOCK_N: tl.constexpr, HADAMARD: tl.constexpr, INPUT_BF16: tl.constexpr,
    ROUND_TO: tl.constexpr, NATIVE_CASTS: tl.constexpr, HAS_SIGNS: tl.constexpr,
    RULE: tl.constexpr, STOCHASTIC: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
    MBITS: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_CODE: tl.constexpr,
):
    """Column-wise MXFP4 (blocks of 32 down a column, optional 32-point Hadamard): the wgrad
    operands and dgrad's Wᵀ.

    A program takes one block of 32 rows and ``BLOCK_N`` columns as a [columns, rows] tile.
    The column index is declared contiguous only in pairs, so each thread loads two columns
    (one 4-byte load per row for bf16, a warp reading 128 contiguous bytes) and Triton keeps
    all 32 rows of its columns in the thread: the butterfly, the block maximum and the packing
    of eight codes per word need no shuffles, unlike the general kernel's transposed tile.
    """
    seed = tl.load(seed_ptr)
    r0 = tl.program_id(0) * 32
    cols = tl.max_contiguous(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), 2)
    rows = r0 + tl.arange(0, 32)
    ok = (cols < N)[:, None] & (rows < M)[None, :]  # zero padding of a partial last block
    x = tl.load(x_ptr + rows.to(tl.int64)[None, :] * stride_m + cols[:, None], mask=ok, other=0)
    v = _to_float32(x, INPUT_BF16)  # [BLOCK_N, 32]
    if HADAMARD > 0:  # M is a multiple of 32: no padding inside a block
        if HAS_SIGNS:
            v = v * tl.load(signs_ptr + tl.arange(0, 32))[None, :]
        v = walsh_hadamard_butterfly(v, 5) * hadamard_scale
        v = round_to_input_dtype(v, ROUND_TO, NATIVE_CASTS)  # hadamard_transform returns it

    amax = tl.reduce(tl.abs(v), 1, max_keeping_nan)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax.to(tl.int32, bitcast=True), amax < float("inf"), RULE, EMAX, MAX_NORMAL, MBITS, MAX_CODE, 4
    )
    scaled = v * inv_scale[:, None]
    limit, sign_weight = limit[:, None], sign_weight[:, None]
    # Word w of an output row (a column of x) holds its elements 8w..8w+7: also their Philox counter.
    words = cols.to(tl.int64)[:, None] * (m_padded // 8) + (r0 // 8 + tl.arange(0, 4))[None, :]
    if STOCHASTIC:
        codes = encode_elements(scaled, philox_noise_runs(seed, words), limit, sign_weight, True, MBITS, EMIN)
    else:
        codes = encode_e2m1_nearest(scaled, limit, sign_weight)
    packed = tl.sum(tl.reshape(codes, [BLOCK_N, 4, 8]) << (tl.arange(0, 8) * 4)[None, None, :], axis=2)
    col_ok = (cols < N)[:, None]
    tl.store(data_ptr + words, packed, mask=col_ok)
    tl.store(scale_ptr + cols.to(tl.int64) * (m_padded // 32) + r0 // 32, scale_codes, mask=cols < N)


@functools.cache
def _max_code(efmt: ElementFormat) -> int:
    """Code of the largest finite element, where saturation clamps."""
    top = torch.tensor([efmt.max_normal])
    return int((encode_e2m1(top) if efmt.bits == 4 else encode_fp8(top, efmt))[0])


def _codes_per_unit(efmt: ElementFormat, block_size: int) -> int:
    """Codes per store unit: a 32-bit word where a block fills whole words, else a byte."""
    unit_bits = 32 if block_size * efmt.bits % 32 == 0 else 8
    return unit_bits // efmt.bits


@dataclass(frozen=True)
class _LaunchPlan:
    """What a quantize call needs besides its tensors: it depends only on shapes and options,
    so it is built (and checked) once per distinct call and cached; a training step makes
    hundreds of calls, and the Python that builds this costs more than the launch itself."""

    kernel: triton.JITFunction
    grid: tuple[int, int]
    row_shapes: tuple[tuple[int, int], tuple[int, int]] | None  # (codes bytes, scales) per orientation
    col_shapes: tuple[tuple[int, int], tuple[int, int]] | None
    word_units: bool  # the kernel writes codes as int32 words (else bytes)
    sizes: tuple[int, ...]  # the integer arguments between the pointers and the seed pointer
    hadamard_scale: float
    constexprs: dict


def common_constexprs(dtype: torch.dtype, on_cuda: bool, fmt: str, scale_rule: str, rounding: str,
                      has_signs: bool) -> dict:
    """Compile-time arguments every quantize kernel takes: input handling, scale rule, rounding
    and the element format's facts."""
    efmt = ELEMENT_FORMATS[fmt]
    return dict(
        INPUT_BF16=dtype == torch.bfloat16, ROUND_TO={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, ""),
        NATIVE_CASTS=on_cuda, HAS_SIGNS=has_signs, RULE=scale_rule, STOCHASTIC=rounding == "stochastic",
        EMAX=efmt.emax, EMIN=efmt.emin, MBITS=efmt.mbits, MAX_NORMAL=efmt.max_normal, MAX_CODE=_max_code(efmt),
    )


@functools.cache
def _zero_seed(device: torch.device) -> torch.Tensor:
    """The key a round-to-nearest launch passes (and never uses): one tensor per device, made
    outside any CUDA-graph capture."""
    return torch.zeros((), dtype=torch.int64, device=device)


def _seed_on(device: torch.device, seed: int | torch.Tensor | None) -> torch.Tensor:
    """The Philox key as an int64 scalar on ``device``. Kernels read it from memory rather than
    take it as an argument, so a captured CUDA graph replays with whatever seed the step drew
    on the device, instead of the one baked in at capture."""
    if seed is None:
        return _zero_seed(device)
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    return torch.tensor(seed, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=4096)
def _launch_plan(
    M: int, N: int, dtype: torch.dtype, strides: tuple[int, int], on_cuda: bool, fmt: str,
    rowwise: bool, colwise: bool, block_size: int, scale_rule: str, rounding: str, hb: int,
    signs_shape: tuple[int, ...] | None, tiling: QuantizeTiling | None,
) -> _LaunchPlan:
    if block_size & (block_size - 1):
        raise ValueError(f"the fused quantizer needs a power-of-two block_size, got {block_size}")
    if signs_shape is not None and not hb:
        raise ValueError("signs are only used with a hadamard_block_size")
    if hb:
        signs = None if signs_shape is None else torch.empty(signs_shape, device="meta")
        for length in (N,) * rowwise + (M,) * colwise:
            check_hadamard_args(length, hb, signs)
    efmt = ELEMENT_FORMATS[fmt]
    kernel = None
    if efmt.bits == 4 and block_size == 32 and strides[1] == 1 and hb in (0, 32) and rowwise != colwise:
        kernel = _quantize_rows_kernel if rowwise else _quantize_cols_kernel  # whole blocks in a thread
        if rowwise and not hb and rounding == "nearest":
            # Fewer instructions, yet slower on the H200: 0.64 of copy against the general
            # kernel's 0.78 (benchmarks/results/2026-12-02-h200-pass10-quantize-ab.txt).
            kernel = None
    orientation = "both" if rowwise and colwise else "rowwise" if rowwise else "colwise"
    if tiling is None:
        general_colwise = kernel is None and orientation == "colwise" and on_cuda
        tiling = GENERAL_COLWISE_TILING if general_colwise else default_tiling(
            orientation, torch.device("cuda" if on_cuda else "cpu"), bool(hb))
    whole_blocks = max(block_size, hb)  # a tile's block axis holds whole MX and Hadamard blocks
    tiling = tiling.fit(whole_blocks if colwise else 1, whole_blocks if rowwise else 1)

    m_padded, n_padded = cdiv(M, block_size) * block_size, cdiv(N, block_size) * block_size
    # Compile-time arguments every kernel takes: input handling, scale rule, rounding, format.
    constexprs = common_constexprs(dtype, on_cuda, fmt, scale_rule, rounding, signs_shape is not None)
    constexprs["num_warps"] = tiling.num_warps
    grid = (cdiv(M, tiling.block_m), cdiv(N, tiling.block_n))
    hadamard_scale = 1 / math.sqrt(hb) if hb else 1.0
    per_unit = _codes_per_unit(efmt, block_size)
    if kernel is _quantize_rows_kernel:
        sizes = (M, N, strides[0], n_padded)
        constexprs.update(BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, HADAMARD=hb)
    elif kernel is _quantize_cols_kernel:
        grid = (cdiv(M, 32), cdiv(N, tiling.block_n))
        sizes = (M, N, strides[0], m_padded)
        constexprs.update(BLOCK_N=tiling.block_n, HADAMARD=hb)
    else:
        kernel = _quantize_mx_kernel
        sizes = (M, N, strides[0], strides[1], m_padded, n_padded)
        constexprs.update(
            ROWWISE=rowwise, COLWISE=colwise, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n,
            HADAMARD=hb, HADAMARD_STAGES=max(hb.bit_length() - 1, 0), BLOCK_SIZE=block_size,
            ELEMENT_BITS=efmt.bits, CODES_PER_UNIT=per_unit,
        )
    return _LaunchPlan(
        kernel, grid,
        storage_shapes(M, N, fmt, block_size) if rowwise else None,
        storage_shapes(N, M, fmt, block_size) if colwise else None,
        per_unit * efmt.bits == 32, sizes, hadamard_scale, constexprs,
    )


def _quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    rowwise: bool,
    colwise: bool,
    block_size: int,
    scale_rule: str,
    rounding: str,
    seed: int | torch.Tensor | None,
    hadamard_block_size: int,
    signs: torch.Tensor | None,
    tiling: QuantizeTiling | None,
) -> tuple[MXTensor | None, MXTensor | None]:
    check_quantize_args(x, fmt, block_size, scale_rule, rounding)
    if x.dim() != 2:
        raise ValueError(f"the fused quantizer takes 2-D tensors, got shape {tuple(x.shape)}")
    M, N = x.shape
    plan = _launch_plan(
        M, N, x.dtype, x.stride(), x.is_cuda, fmt, rowwise, colwise, block_size, scale_rule, rounding,
        hadamard_block_size, None if signs is None else tuple(signs.shape), tiling,
    )
    pointers = [x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                x if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous()]
    results = []
    for axis, shapes in ((1, plan.row_shapes), (0, plan.col_shapes)):
        if shapes is None:
            results.append(None)
            if plan.kernel is _quantize_mx_kernel:
                pointers += [None, None]  # the orientation it does not write
            continue
        data = torch.empty(shapes[0], dtype=torch.uint8, device=x.device)
        scales = torch.empty(shapes[1], dtype=torch.uint8, device=x.device)
        pointers += [data.view(torch.int32) if plan.word_units else data, scales]
        results.append(MXTensor(data, scales, fmt, axis, block_size, x.shape))
    seed_ptr = _seed_on(x.device, seed) if rounding == "stochastic" else _zero_seed(x.device)
    plan.kernel[plan.grid](*pointers, *plan.sizes, seed_ptr, plan.hadamard_scale, **plan.constexprs)
    return results[0], results[1]


def quantize_mx_triton(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    tiling: QuantizeTiling | None = None,
) -> MXTensor:
    """Fused ``quantize_mx(hadamard_transform(x) if hadamard_block_size else x, ...)`` of 2-D ``x``.

    ``axis=-1`` (or 1) puts blocks along rows; ``axis=0`` blocks along columns, stored
    transposed (``data`` is ``[cols, rows_padded / 2]`` for MXFP4), which is the operand
    layout that dgrad and wgrad contract over. The Hadamard rotation acts along ``axis`` too.
    """
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"axis must be one of (-2, -1, 0, 1) for a 2-D tensor, got {axis}")
    rowwise = axis % 2 == 1
    row, col = _quantize(
        x, fmt, rowwise=rowwise, colwise=not rowwise, block_size=block_size,
        scale_rule=scale_rule, rounding=rounding, seed=seed,
        hadamard_block_size=hadamard_block_size, signs=signs, tiling=tiling,
    )
    return row if rowwise else col


def quantize_mx_triton_both(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    tiling: QuantizeTiling | None = None,
) -> tuple[MXTensor, MXTensor]:
    """``(quantize_mx_triton(x, axis=1, ...), quantize_mx_triton(x, axis=0, ...))``, one read."""
    return _quantize(
        x, fmt, rowwise=True, colwise=True, block_size=block_size, scale_rule=scale_rule,
        rounding=rounding, seed=seed, hadamard_block_size=hadamard_block_size, signs=signs,
        tiling=tiling,
    )
