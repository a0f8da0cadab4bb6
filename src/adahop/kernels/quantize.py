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
block maxima are float maxima that keep NaN. ``benchmarks/quantize/sass_counts.py`` prints the static
instruction counts per element; ``adahop bench --only quantize`` measures each kernel against
copy bandwidth (results in ``benchmarks/quantize/``).

The tensor is processed in ``[block_m, block_n]`` tiles; a tile's block axis holds whole MX
blocks and whole Hadamard blocks. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats.elements import ElementFormat, encode_e2m1, encode_fp8
from ..formats.mx import ELEMENT_FORMATS, MXTensor, check_quantize_args, storage_shapes
from ..transforms.hadamard import check_hadamard_args
from .mx_math import (
    encode_e2m1_nearest,
    encode_elements,
    max_keeping_nan,
    philox_noise_runs,
    round_to_input_dtype,
    walsh_hadamard_butterfly,
)
from .launch import cdiv
from .quantize_blocks import block_scales, quantize_tile, record_scores, row_blocks, row_word, to_float32
from .quantize_tiling import GENERAL_COLWISE_TILING, QuantizeTiling, default_tiling


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
    HADAMARD: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    ROUND_TO: tl.constexpr,
    NATIVE_CASTS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    RULE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EMAX: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_CODE: tl.constexpr,
    SCORES: tl.constexpr,
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
        x_ptr,
        signs_ptr,
        rows,
        blocks,
        M,
        N,
        stride_m,
        hadamard_scale,
        HADAMARD,
        INPUT_BF16,
        ROUND_TO,
        NATIVE_CASTS,
        HAS_SIGNS,
        RULE,
        EMAX,
        MAX_NORMAL,
        MBITS,
        MAX_CODE,
        SCORES,
    )
    if SCORES:  # a row spans programs along N
        record_scores(score_ptr, rows, score, rows < M)

    # Word w of a row holds elements 8w..8w+7; its index is also their Philox counter.
    n_blocks = n_padded // 32
    word0 = rows.to(tl.int64)[:, None] * (n_padded // 8) + (blocks * 4)[None, :]
    w0 = row_word(v0, inv_scale, limit, sign_weight, word0, seed, STOCHASTIC, MBITS, EMIN)
    w1 = row_word(v1, inv_scale, limit, sign_weight, word0 + 1, seed, STOCHASTIC, MBITS, EMIN)
    w2 = row_word(v2, inv_scale, limit, sign_weight, word0 + 2, seed, STOCHASTIC, MBITS, EMIN)
    w3 = row_word(v3, inv_scale, limit, sign_weight, word0 + 3, seed, STOCHASTIC, MBITS, EMIN)
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
    stride_m,
    m_padded,
    seed_ptr,
    hadamard_scale,
    BLOCK_N: tl.constexpr,
    HADAMARD: tl.constexpr,
    INPUT_BF16: tl.constexpr,
    ROUND_TO: tl.constexpr,
    NATIVE_CASTS: tl.constexpr,
    HAS_SIGNS: tl.constexpr,
    RULE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    EMAX: tl.constexpr,
    EMIN: tl.constexpr,
    MBITS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_CODE: tl.constexpr,
    SCORES: tl.constexpr,
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
    v = to_float32(x, INPUT_BF16)  # [BLOCK_N, 32]
    if SCORES:  # a column (an output row) spans programs along M
        record_scores(score_ptr, cols, tl.reduce(tl.abs(v), 1, max_keeping_nan), cols < N)
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
    sizes: dict[str, int]  # the kernel's integer arguments, by name
    outputs: tuple[tuple[str, str] | None, tuple[str, str] | None]  # (codes, scales) argument names per orientation
    hadamard_scale: float
    constexprs: dict


def common_constexprs(
    dtype: torch.dtype, on_cuda: bool, fmt: str, scale_rule: str, rounding: str, has_signs: bool, scores: bool
) -> dict:
    """Compile-time arguments every quantize kernel takes: input handling, scale rule, rounding,
    the element format's facts, and whether it records each output row's outlier score."""
    efmt = ELEMENT_FORMATS[fmt]
    return dict(
        SCORES=scores,
        INPUT_BF16=dtype == torch.bfloat16,
        ROUND_TO={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, ""),
        NATIVE_CASTS=on_cuda,
        HAS_SIGNS=has_signs,
        RULE=scale_rule,
        STOCHASTIC=rounding == "stochastic",
        EMAX=efmt.emax,
        EMIN=efmt.emin,
        MBITS=efmt.mbits,
        MAX_NORMAL=efmt.max_normal,
        MAX_CODE=_max_code(efmt),
    )


@functools.cache
def zero_seed(device: torch.device) -> torch.Tensor:
    """The key a round-to-nearest launch passes (and never uses): one tensor per device, made
    outside any CUDA-graph capture."""
    return torch.zeros((), dtype=torch.int64, device=device)


def seed_pointer(device: torch.device, seed: int | torch.Tensor | None) -> torch.Tensor:
    """The Philox key as an int64 scalar on ``device``. Kernels read it from memory rather than
    take it as an argument, so a captured CUDA graph replays with whatever seed the step drew
    on the device, instead of the one baked in at capture."""
    if seed is None:
        return zero_seed(device)
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    return torch.tensor(seed, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=4096)
def _launch_plan(
    M: int,
    N: int,
    dtype: torch.dtype,
    strides: tuple[int, int],
    on_cuda: bool,
    fmt: str,
    rowwise: bool,
    colwise: bool,
    block_size: int,
    scale_rule: str,
    rounding: str,
    hb: int,
    signs_shape: tuple[int, ...] | None,
    scores: bool,
    tiling: QuantizeTiling | None,
) -> _LaunchPlan:
    if block_size & (block_size - 1):
        raise ValueError(f"the fused quantizer needs a power-of-two block_size, got {block_size}")
    if scores and rowwise and colwise:
        raise ValueError("scores are recorded for one orientation at a time")
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
            # Fewer instructions, yet slower on the H200 than the general kernel
            # (benchmarks/quantize/2026-12-02-h200-pass10-quantize-ab.txt).
            kernel = None
    orientation = "both" if rowwise and colwise else "rowwise" if rowwise else "colwise"
    if tiling is None:
        general_colwise = kernel is None and orientation == "colwise" and on_cuda
        tiling = (
            GENERAL_COLWISE_TILING
            if general_colwise
            else default_tiling(orientation, torch.device("cuda" if on_cuda else "cpu"), bool(hb))
        )
    whole_blocks = max(block_size, hb)  # a tile's block axis holds whole MX and Hadamard blocks
    tiling = tiling.fit(whole_blocks if colwise else 1, whole_blocks if rowwise else 1)

    m_padded, n_padded = cdiv(M, block_size) * block_size, cdiv(N, block_size) * block_size
    # Compile-time arguments every kernel takes: input handling, scale rule, rounding, format.
    constexprs = common_constexprs(dtype, on_cuda, fmt, scale_rule, rounding, signs_shape is not None, scores)
    constexprs["num_warps"] = tiling.num_warps
    constexprs["maxnreg"] = tiling.max_registers
    grid = (cdiv(M, tiling.block_m), cdiv(N, tiling.block_n))
    hadamard_scale = 1 / math.sqrt(hb) if hb else 1.0
    per_unit = _codes_per_unit(efmt, block_size)
    if kernel is _quantize_rows_kernel:
        sizes = dict(M=M, N=N, stride_m=strides[0], n_padded=n_padded)
        outputs = (("data_ptr", "scale_ptr"), None)
        constexprs.update(BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, HADAMARD=hb)
    elif kernel is _quantize_cols_kernel:
        grid = (cdiv(M, 32), cdiv(N, tiling.block_n))
        sizes = dict(M=M, N=N, stride_m=strides[0], m_padded=m_padded)
        outputs = (None, ("data_ptr", "scale_ptr"))
        constexprs.update(BLOCK_N=tiling.block_n, HADAMARD=hb)
    else:
        kernel = _quantize_mx_kernel
        sizes = dict(M=M, N=N, stride_m=strides[0], stride_n=strides[1], m_padded=m_padded, n_padded=n_padded)
        outputs = (("row_data_ptr", "row_scale_ptr"), ("col_data_ptr", "col_scale_ptr"))
        constexprs.update(
            ROWWISE=rowwise,
            COLWISE=colwise,
            BLOCK_M=tiling.block_m,
            BLOCK_N=tiling.block_n,
            HADAMARD=hb,
            HADAMARD_STAGES=max(hb.bit_length() - 1, 0),
            BLOCK_SIZE=block_size,
            ELEMENT_BITS=efmt.bits,
            CODES_PER_UNIT=per_unit,
        )
    return _LaunchPlan(
        kernel,
        grid,
        storage_shapes(M, N, fmt, block_size) if rowwise else None,
        storage_shapes(N, M, fmt, block_size) if colwise else None,
        per_unit * efmt.bits == 32,
        sizes,
        outputs,
        hadamard_scale,
        constexprs,
    )


class QuantizeLaunch(NamedTuple):
    """One quantize call, ready to go: ``kernel[grid](**arguments)`` writes ``row`` and ``col``
    (the orientations asked for; None for the other)."""

    kernel: triton.JITFunction
    grid: tuple[int, int]
    arguments: dict  # every kernel parameter by name, and the launch options (num_warps)
    row: MXTensor | None
    col: MXTensor | None
    score: torch.Tensor | None  # each stored row's outlier score, when asked


def quantize_launch(
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
    scores: bool,
    tiling: QuantizeTiling | None,
) -> QuantizeLaunch:
    """The launch that quantizes ``x``, prepared (arguments checked, outputs allocated) but not
    made: what ``_quantize`` runs, and what ``benchmarks/linear/host_overhead.py`` times on its own."""
    check_quantize_args(x, fmt, block_size, scale_rule, rounding)
    if x.dim() != 2:
        raise ValueError(f"the fused quantizer takes 2-D tensors, got shape {tuple(x.shape)}")
    M, N = x.shape
    plan = _launch_plan(
        M,
        N,
        x.dtype,
        x.stride(),
        x.is_cuda,
        fmt,
        rowwise,
        colwise,
        block_size,
        scale_rule,
        rounding,
        hadamard_block_size,
        None if signs is None else tuple(signs.shape),
        scores,
        tiling,
    )
    # Zeros: the kernels raise each score to their part's abs-max (atomically, as float32 bits).
    score = torch.zeros(M if rowwise else N, dtype=torch.float32, device=x.device) if scores else None
    args = dict(
        x_ptr=x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        signs_ptr=x if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous(),
        score_ptr=None if score is None else score.view(torch.int32),
    )
    results = []
    for axis, shapes, names in ((1, plan.row_shapes, plan.outputs[0]), (0, plan.col_shapes, plan.outputs[1])):
        if shapes is None:
            results.append(None)
            if names is not None:  # the general kernel, told not to write this orientation
                args |= dict.fromkeys(names)
            continue
        data = torch.empty(shapes[0], dtype=torch.uint8, device=x.device)
        scales = torch.empty(shapes[1], dtype=torch.uint8, device=x.device)
        args |= {names[0]: data.view(torch.int32) if plan.word_units else data, names[1]: scales}
        results.append(MXTensor(data, scales, fmt, axis, block_size, x.shape))
    seed_ptr = seed_pointer(x.device, seed) if rounding == "stochastic" else zero_seed(x.device)
    args.update(plan.sizes, seed_ptr=seed_ptr, hadamard_scale=plan.hadamard_scale, **plan.constexprs)
    return QuantizeLaunch(plan.kernel, plan.grid, args, results[0], results[1], score)


def _quantize(x: torch.Tensor, fmt: str, **options) -> tuple[MXTensor | None, MXTensor | None, torch.Tensor | None]:
    launch = quantize_launch(x, fmt, **options)
    launch.kernel[launch.grid](**launch.arguments)
    return launch.row, launch.col, launch.score


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
    scores: bool = False,
    tiling: QuantizeTiling | None = None,
) -> MXTensor | tuple[MXTensor, torch.Tensor]:
    """Fused ``quantize_mx(hadamard_transform(x) if hadamard_block_size else x, ...)`` of 2-D ``x``.

    ``axis=-1`` (or 1) puts blocks along rows; ``axis=0`` blocks along columns, stored
    transposed (``data`` is ``[cols, rows_padded / 2]`` for MXFP4), which is the operand
    layout that dgrad and wgrad contract over. The Hadamard rotation acts along ``axis`` too.
    ``scores``: also return each stored row's outlier score, ``policy.selection.row_scores``
    along ``axis`` (float32), from the same read.
    """
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"axis must be one of (-2, -1, 0, 1) for a 2-D tensor, got {axis}")
    rowwise = axis % 2 == 1
    row, col, score = _quantize(
        x,
        fmt,
        rowwise=rowwise,
        colwise=not rowwise,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=scores,
        tiling=tiling,
    )
    q = row if rowwise else col
    return (q, score) if scores else q


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
    row, col, _ = _quantize(
        x,
        fmt,
        rowwise=True,
        colwise=True,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=False,
        tiling=tiling,
    )
    return row, col
