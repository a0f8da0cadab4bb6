"""Triton device functions the quantize kernels are built from: block scales, a tile's codes,
and the row-wise block layout (four 8-wide slices per block) that keeps a block in one thread.

No kernels here (``kernels/quantize.py`` and ``kernels/quantize_fold.py`` hold them); every
function is ``@triton.jit`` and is inlined into its caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mx_math import (
    E8M0_NAN,
    F32_BIAS,
    F32_INF_BITS,
    bf16_bits_to_float,
    encode_e2m1_nearest,
    encode_elements,
    exp2_int,
    max_keeping_nan,
    pack_codes,
    philox_noise,
    philox_noise_runs,
    philox_noise_slices,
    round_to_input_dtype,
    shared_exponent,
    walsh_hadamard_butterfly,
)


@triton.jit
def block_scales(amax_bits, finite, SPEC: tl.constexpr):
    """Per block, from its maximum's float32 bits: ``2**-s`` (s <= 126 for every finite amax, so a
    normal number), the code limit and the sign weight (both 0 for a NaN/Inf block, whose element
    codes become 0) and the E8M0 code (255 for NaN/Inf)."""
    RULE: tl.constexpr = SPEC.rule
    s = shared_exponent(amax_bits, RULE, SPEC.emax, SPEC.max_normal, SPEC.mbits)
    limit = tl.where(finite, SPEC.max_code, 0).to(tl.uint32)
    sign_weight = tl.where(finite, 1 << (SPEC.element_bits - 1), 0).to(tl.uint32)
    scale_code = tl.where(finite, s + F32_BIAS, E8M0_NAN).to(tl.uint8)
    return exp2_int(-s), limit, sign_weight, scale_code


@triton.jit
def quantize_tile(
    v,
    row_start,
    col_start,
    n_rows,
    length,
    padded_len,
    data_ptr,
    scale_ptr,
    signs_ptr,
    seed,
    hadamard_scale,
    SPEC: tl.constexpr,
):
    """Quantize float32 tile ``v`` [R, C] with blocks along its last axis and store it.

    Rows are ``row_start + i`` of the output, columns ``col_start + j`` of its block axis
    (``length`` valid, ``padded_len`` stored). ``data_ptr`` points to units (uint8 or uint32)
    of ``SPEC.codes_per_unit`` packed codes.
    """
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    HADAMARD: tl.constexpr = SPEC.hadamard
    BLOCK_SIZE: tl.constexpr = SPEC.block_size
    ELEMENT_BITS: tl.constexpr = SPEC.element_bits
    CODES_PER_UNIT: tl.constexpr = SPEC.codes_per_unit
    rows = row_start + tl.arange(0, R)
    cols = col_start + tl.arange(0, C)

    if HADAMARD > 0:
        groups = tl.reshape(v, [R * C // HADAMARD, HADAMARD])
        if SPEC.has_signs:
            groups = groups * tl.load(signs_ptr + tl.arange(0, HADAMARD))[None, :]
        groups = walsh_hadamard_butterfly(groups, SPEC.hadamard_stages) * hadamard_scale
        v = tl.reshape(groups, [R, C])
        ROUND_TO: tl.constexpr = SPEC.round_to
        v = round_to_input_dtype(v, ROUND_TO, SPEC.native_casts)  # hadamard_transform returns it
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
    inv_scale, limit, sign_weight, scale_codes = block_scales(amax_bits, finite, SPEC)
    scaled = blocks * inv_scale[:, :, None]
    limit, sign_weight = limit[:, :, None], sign_weight[:, :, None]
    if SPEC.stochastic:
        row_offsets = rows.to(tl.int64) * padded_len
        if BLOCK_SIZE % 16 == 0:  # runs of sixteen elements share a Philox call
            runs = (col_start + tl.arange(0, C // 16) * 16) // 16
            noise = philox_noise_runs(seed, row_offsets[:, None] // 16 + runs[None, :])
        else:
            noise = philox_noise(seed, row_offsets[:, None] + cols[None, :])
        noise = tl.reshape(noise, [R, C // BLOCK_SIZE, BLOCK_SIZE])
        codes = encode_elements(scaled, noise, limit, sign_weight, True, SPEC.mbits, SPEC.emin)
    elif ELEMENT_BITS == 4:
        codes = encode_e2m1_nearest(scaled, limit, sign_weight)
    else:
        codes = encode_elements(scaled, 0, limit, sign_weight, False, SPEC.mbits, SPEC.emin)
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
def to_float32(x, INPUT_BF16: tl.constexpr):
    if INPUT_BF16:
        return bf16_bits_to_float(x)
    return x.to(tl.float32)


@triton.jit
def row_slice(x, signs_ptr, k: tl.constexpr, SPEC: tl.constexpr):
    """Slice ``k`` (elements 8k..8k+7 of each block, [R, NB, 8]) as float32, after butterfly
    stages 1, 2, 4 when ``SPEC.hadamard``."""
    R: tl.constexpr = x.shape[0]
    NB: tl.constexpr = x.shape[1]
    v = to_float32(x, SPEC.input_bf16)
    if SPEC.hadamard > 0:
        if SPEC.has_signs:
            v = v * tl.load(signs_ptr + 8 * k + tl.arange(0, 8))[None, None, :]
        v = tl.reshape(walsh_hadamard_butterfly(tl.reshape(v, [R * NB, 8]), 3), [R, NB, 8])
    return v


@triton.jit
def h32_finish(v, hadamard_scale, SPEC: tl.constexpr):
    """Normalise a transformed slice and round it to the input dtype, as the reference does.

    No padding to zero: a Hadamard needs a row length that is a multiple of 32, so a block is
    either whole or wholly outside the row (loaded as zeros, never stored).
    """
    v = v * hadamard_scale
    ROUND_TO: tl.constexpr = SPEC.round_to
    v = round_to_input_dtype(v, ROUND_TO, SPEC.native_casts)  # hadamard_transform returns it
    return v


@triton.jit
def row_blocks(
    x_ptr,
    signs_ptr,
    rows,
    blocks,
    M,
    N,
    stride_m,
    hadamard_scale,
    SPEC: tl.constexpr,
):
    """Blocks ``blocks`` of ``rows`` as four float32 slices [R, NB, 8] (elements 8k..8k+7 of each
    block, after the 32-point Hadamard when ``SPEC.hadamard``), with each block's inverse scale, code
    limit and sign weight ([R, NB, 1]) and E8M0 code ([R, NB]); with ``SPEC.scores``, also each row's
    abs-max over these blocks before the Hadamard ([R]; else 0), its outlier score.

    Each block is loaded as four 8-wide slices (16-byte loads for bf16) that share one register
    layout, so butterfly stages 1, 2, 4 run inside a slice and stages 8, 16 between slices, in
    the reference's order, and the block maximum stays in the thread.
    """
    cols = (blocks * 32)[None, :, None] + tl.arange(0, 8)[None, None, :]  # slice 0 of each block
    offs = (rows.to(tl.int64) * stride_m)[:, None, None] + cols
    row_ok = (rows < M)[:, None, None]  # columns past N load as zeros: the padding of a partial block
    x0 = tl.load(x_ptr + offs, mask=row_ok & (cols < N), other=0)
    v0 = row_slice(x0, signs_ptr, 0, SPEC)
    x1 = tl.load(x_ptr + offs + 8, mask=row_ok & (cols + 8 < N), other=0)
    v1 = row_slice(x1, signs_ptr, 1, SPEC)
    x2 = tl.load(x_ptr + offs + 16, mask=row_ok & (cols + 16 < N), other=0)
    v2 = row_slice(x2, signs_ptr, 2, SPEC)
    x3 = tl.load(x_ptr + offs + 24, mask=row_ok & (cols + 24 < N), other=0)
    v3 = row_slice(x3, signs_ptr, 3, SPEC)
    score = 0.0
    if SPEC.scores:  # from the loaded values, before the Hadamard
        BF16: tl.constexpr = SPEC.input_bf16  # a plain local would compile both of to_float32's branches
        score = max_keeping_nan(
            max_keeping_nan(tl.abs(to_float32(x0, BF16)), tl.abs(to_float32(x1, BF16))),
            max_keeping_nan(tl.abs(to_float32(x2, BF16)), tl.abs(to_float32(x3, BF16))),
        )
        score = tl.reduce(tl.reduce(score, 2, max_keeping_nan), 1, max_keeping_nan)
    if SPEC.hadamard > 0:
        # Stage 8 pairs slices (0, 1) and (2, 3); stage 16 pairs (0, 2) and (1, 3).
        a0, a1, a2, a3 = v0 + v1, v0 - v1, v2 + v3, v2 - v3
        v0 = h32_finish(a0 + a2, hadamard_scale, SPEC)
        v1 = h32_finish(a1 + a3, hadamard_scale, SPEC)
        v2 = h32_finish(a0 - a2, hadamard_scale, SPEC)
        v3 = h32_finish(a1 - a3, hadamard_scale, SPEC)

    amax = max_keeping_nan(max_keeping_nan(tl.abs(v0), tl.abs(v1)), max_keeping_nan(tl.abs(v2), tl.abs(v3)))
    amax = tl.reduce(amax, 2, max_keeping_nan)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax.to(tl.int32, bitcast=True), amax < float("inf"), SPEC
    )
    return (v0, v1, v2, v3, inv_scale[:, :, None], limit[:, :, None], sign_weight[:, :, None], scale_codes, score)


@triton.jit
def record_scores(score_ptr, lines, amax, ok):
    """Raise the scores of ``lines`` to this program's abs-max of each (``amax``, non-negative or
    NaN) by an atomic max on the float32 bits, which order like the values (NaN above Inf): a
    line split over programs ends with the largest part in any order. The scores start at 0."""
    tl.atomic_max(score_ptr + lines, amax.to(tl.int32, bitcast=True), mask=ok, sem="relaxed")


@triton.jit
def slice_noise(seed, counters, SPEC: tl.constexpr):
    """Stochastic-rounding noise of a block's slices (0, 1) at Philox ``counters`` [R, NB] (the
    index of the 16-element run of the row that starts the block), or of slices (2, 3) at
    ``counters + 1``: one call for two slices. Zeros (unused, compiled away) under round-to-nearest."""
    if SPEC.stochastic:
        return philox_noise_slices(seed, counters)
    zeros = tl.zeros([counters.shape[0], counters.shape[1], 8], dtype=tl.uint32)
    return zeros, zeros


@triton.jit
def row_codes(v, inv_scale, limit, sign_weight, noise, SPEC: tl.constexpr):
    """E2M1 codes of a slice ([R, NB, 8], block scale applied here), with its ``slice_noise``."""
    scaled = v * inv_scale
    if SPEC.stochastic:
        return encode_elements(scaled, noise, limit, sign_weight, True, SPEC.mbits, SPEC.emin)
    return encode_e2m1_nearest(scaled, limit, sign_weight)


@triton.jit
def row_word(v, inv_scale, limit, sign_weight, noise, SPEC: tl.constexpr):
    """A slice's 8 codes packed into one 32-bit word per block, first code lowest."""
    codes = row_codes(v, inv_scale, limit, sign_weight, noise, SPEC)
    return tl.sum(codes << (tl.arange(0, 8) * 4)[None, None, :], axis=2)
