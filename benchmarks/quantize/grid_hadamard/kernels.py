"""Prototype MXFP4 quantize kernels (block 32, 32-point Hadamard) whose Hadamard runs on the tensor
cores: grid rounding (``spec.py``), ``tl.dot`` with the +-1 matrix in bfloat16, float32 accumulation.

They equal ``quantize_mx(grid_hadamard_transform(x, axis=axis, signs=signs), axis=axis, ...)`` bit
for bit: bfloat16 grid values are bfloat16 operands (float16 and float32 ones are split into two
exact bfloat16 parts, two dots into one accumulator), every product and partial sum is a multiple
of the grid below ``2**22`` of its units, so no accumulation order, alignment or truncation of
the tensor cores can change it. Scales, noise, encoding and packing are the device functions of
``adahop.kernels`` that today's ``quantize_mxfp4`` kernels use; each MX block is one row of a
``[blocks, 32]`` tile, as in the column-wise kernel. No outlier scores and no padding inside a block
(a prototype for timing; ``benchmarks/quantize/2026-12-05-hadamard-tensor-cores.md``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from adahop.formats.mx import MXTensor, check_quantize_args, storage_shapes
from adahop.kernels.launch import cdiv, quantize_spec, seed_pointer, zero_seed
from adahop.kernels.mx_math import (
    encode_e2m1_nearest,
    encode_elements,
    exponent_field,
    max_keeping_nan,
    philox_noise_runs,
    round_to_bf16,
    round_to_input_dtype,
)
from adahop.kernels.quantize_blocks import block_scales, to_float32
from adahop.transforms.hadamard import check_hadamard_args, hadamard_matrix

from . import spec

GRID_BITS = tl.constexpr(spec.GRID_BITS)
MIN_EXPONENT = tl.constexpr(spec.MIN_EXPONENT)
MAX_EXPONENT = tl.constexpr(spec.MAX_EXPONENT)


@triton.jit
def bf16_operand(v, NATIVE: tl.constexpr):
    """float32 ``v`` as a bfloat16 ``tl.dot`` operand, rounded to nearest. The interpreter's dot
    multiplies bfloat16's raw bits (Triton 3.9), so there the operand stays float32 holding the
    rounded value: the same products, summed exactly either way."""
    if NATIVE:
        operand = v.to(tl.bfloat16)
    else:
        operand = round_to_bf16(v, False)
    return operand


def permuted_hadamard(device: torch.device) -> torch.Tensor:
    """The 32 x 32 Sylvester Hadamard matrix with its columns reordered so that the dot's accumulator
    holds whole packed words in one thread: column ``c = 8k + 2w + b`` is output element
    ``j = 8w + 2k + b``. An MMA accumulator gives lane ``w`` of a quad the columns ``8k + 2w + b``
    (k = 0..3, b = 0, 1): elements ``8w .. 8w + 7``, word ``w``. bfloat16 on CUDA, float32 for the
    interpreter (``bf16_operand``)."""
    c = torch.arange(32)
    j = ((c >> 1) & 3) * 8 + (c >> 3) * 2 + (c & 1)
    h = hadamard_matrix(32)[:, j].contiguous()
    return h.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)


@triton.jit
def load_hadamard(h_ptr):
    return tl.load(h_ptr + tl.arange(0, 32)[:, None] * 32 + tl.arange(0, 32)[None, :])


@triton.jit
def grid_hadamard(v, h, hadamard_scale, SPEC: tl.constexpr):
    """The grid Hadamard of each row of ``v`` [R, 32] (float32, signs applied), rounded to the input
    dtype, in ``permuted_hadamard``'s column order (``h``, that matrix as a dot operand); NaN rows
    for blocks that become NaN (the MMA carries NaN through). ``hadamard_scale`` is float32
    ``1/sqrt(32)``."""
    amax = tl.reduce(tl.abs(v), 1, max_keeping_nan)
    e = tl.maximum(exponent_field(amax.to(tl.int32, bitcast=True)), MIN_EXPONENT)
    # 1.5 * 2**(e + 8): its float32 spacing is the grid; adding it rounds v once, ties to even.
    magic = (((e + (23 - GRID_BITS + 127)) << 23) | 0x400000).to(tl.float32, bitcast=True)
    magic = tl.where((amax < float("inf")) & (e <= MAX_EXPONENT), magic, float("nan"))[:, None]
    q = v + magic - magic  # exact; +0 where v vanishes
    NATIVE: tl.constexpr = SPEC.native_casts
    if SPEC.input_bf16:  # bfloat16 grid values are bfloat16 values
        s = tl.dot(bf16_operand(q, NATIVE), h, out_dtype=tl.float32)
    else:  # float16 and float32 grid values: two exact bfloat16 parts, both multiples of the grid
        hi = round_to_bf16(q, NATIVE)
        s = tl.dot(bf16_operand(hi, NATIVE), h, out_dtype=tl.float32)
        s = tl.dot(bf16_operand(q - hi, NATIVE), h, acc=s, out_dtype=tl.float32)
    # "+ 0.0" (one FFMA, as cheap as the FMUL) turns a -0 into +0: the butterfly never makes one, but
    # the sign of an MMA's exact zero is the hardware's.
    ROUND_TO: tl.constexpr = SPEC.round_to
    return round_to_input_dtype(s * hadamard_scale + 0.0, ROUND_TO, NATIVE)


@triton.jit
def quantize_block_rows(y, word0, seed, SPEC: tl.constexpr):
    """Codes packed into words ([R, 4]) and E8M0 codes ([R]) of blocks ``y`` [R, 32] (columns in
    ``permuted_hadamard``'s order) whose first word is ``word0`` [R] (int64: eight elements a word,
    sixteen a Philox call, so the block's calls are ``word0 // 2`` and the next)."""
    R: tl.constexpr = y.shape[0]
    amax = tl.reduce(tl.abs(y), 1, max_keeping_nan)
    inv_scale, limit, sign_weight, scale_codes = block_scales(
        amax.to(tl.int32, bitcast=True), amax < float("inf"), SPEC
    )
    scaled = y * inv_scale[:, None]
    limit, sign_weight = limit[:, None], sign_weight[:, None]
    words = word0[:, None] + tl.arange(0, 4)[None, :]
    if SPEC.stochastic:
        calls = (word0 // 2)[:, None] + tl.arange(0, 2)[None, :]
        noise = tl.reshape(philox_noise_runs(seed, calls), [R, 4, 4, 2])  # [R, w, k, b]
        noise = tl.reshape(tl.permute(noise, (0, 2, 1, 3)), [R, 32])  # column order 8k + 2w + b
        codes = encode_elements(scaled, noise, limit, sign_weight, True, SPEC.mbits, SPEC.emin)
    else:
        codes = encode_e2m1_nearest(scaled, limit, sign_weight)
    # Code (k, w, b) is element 2k + b of word w: nibble 2k + b.
    shifts = (tl.arange(0, 4) * 8)[:, None, None] + (tl.arange(0, 2) * 4)[None, None, :]
    packed = tl.sum(tl.sum(tl.reshape(codes, [R, 4, 4, 2]) << shifts[None, :, :, :], axis=3), axis=1)
    return words, packed, scale_codes


@triton.jit
def _grid_rows_kernel(
    x_ptr,
    signs_ptr,
    h_ptr,
    data_ptr,
    scale_ptr,
    M,
    N,
    stride_m,
    seed_ptr,
    hadamard_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
):
    """Row-wise: a [BLOCK_M, BLOCK_N] tile as [BLOCK_M * BLOCK_N / 32, 32] blocks (N % 32 == 0)."""
    NB: tl.constexpr = BLOCK_N // 32
    R: tl.constexpr = BLOCK_M * NB
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    ok = (rows < M)[:, None] & (blocks < N // 32)[None, :]
    cols = (blocks * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]
    x = tl.load(x_ptr + (rows.to(tl.int64) * stride_m)[:, None, None] + cols, mask=ok[:, :, None], other=0)
    v = to_float32(x, SPEC.input_bf16)
    if SPEC.has_signs:
        v = v * tl.load(signs_ptr + tl.arange(0, 32))[None, None, :]
    y = grid_hadamard(tl.reshape(v, [R, 32]), load_hadamard(h_ptr), hadamard_scale, SPEC)
    word0 = rows.to(tl.int64)[:, None] * (N // 8) + (blocks * 4)[None, :]
    words, packed, scale_codes = quantize_block_rows(y, tl.reshape(word0, [R]), seed, SPEC)
    ok = tl.reshape(ok, [R])
    tl.store(data_ptr + words, packed, mask=ok[:, None])
    scale_offs = rows.to(tl.int64)[:, None] * (N // 32) + blocks[None, :]
    tl.store(scale_ptr + tl.reshape(scale_offs, [R]), scale_codes, mask=ok)


@triton.jit
def _grid_cols_kernel(
    x_ptr,
    signs_ptr,
    h_ptr,
    data_ptr,
    scale_ptr,
    M,
    N,
    seed_ptr,
    hadamard_scale,
    STRIDE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
):
    """Column-wise: 32 rows and BLOCK_N columns as a [BLOCK_N, 32] tile (M % 32 == 0), one block per
    tile row, like ``quantize_mxfp4._quantize_cols_kernel``."""
    seed = tl.load(seed_ptr)
    r0 = tl.program_id(0) * 32
    cols = tl.max_contiguous(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), 1)
    rows = tl.arange(0, 32)
    ok = cols < N
    x_ptrs = x_ptr + r0.to(tl.int64) * STRIDE_M + cols[:, None] + (rows * STRIDE_M)[None, :]
    v = to_float32(tl.load(x_ptrs, mask=ok[:, None], other=0), SPEC.input_bf16)
    if SPEC.has_signs:
        v = v * tl.load(signs_ptr + rows)[None, :]
    y = grid_hadamard(v, load_hadamard(h_ptr), hadamard_scale, SPEC)
    word0 = cols.to(tl.int64) * (M // 8) + r0 // 8
    words, packed, scale_codes = quantize_block_rows(y, word0, seed, SPEC)
    tl.store(data_ptr + words, packed, mask=ok[:, None])
    tl.store(scale_ptr + cols.to(tl.int64) * (M // 32) + r0 // 32, scale_codes, mask=ok)


def grid_launch(
    x: torch.Tensor,
    *,
    axis: int,
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    signs: torch.Tensor | None = None,
    block_m: int = 8,
    block_n: int = 256,
    num_warps: int = 2,
) -> tuple[triton.JITFunction, tuple[int, int], dict, MXTensor]:
    """(kernel, grid, arguments, output) of the grid-Hadamard MXFP4 quantizer of 2-D ``x`` along
    ``axis`` (0 or 1); ``block_m`` is the row-wise tile's rows, ``block_n`` either tile's columns."""
    check_quantize_args(x, "mxfp4", 32, "floor", rounding)
    M, N = x.shape
    rowwise = axis % 2 == 1
    check_hadamard_args(N if rowwise else M, 32, signs)
    if x.stride(1) != 1:
        raise ValueError("the prototype takes a tensor with contiguous rows; call .contiguous() first")
    spec = quantize_spec(x.dtype, x.is_cuda, "mxfp4", 32, "floor", rounding, 32, signs is not None, False)
    codes_shape, scales_shape = storage_shapes(M, N, "mxfp4", 32) if rowwise else storage_shapes(N, M, "mxfp4", 32)
    data = torch.empty(codes_shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(scales_shape, dtype=torch.uint8, device=x.device)
    args = dict(
        x_ptr=x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        signs_ptr=x if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous(),
        h_ptr=permuted_hadamard(x.device),
        data_ptr=data.view(torch.int32),
        scale_ptr=scales,
        M=M,
        N=N,
        seed_ptr=seed_pointer(x.device, seed) if rounding == "stochastic" else zero_seed(x.device),
        hadamard_scale=1 / math.sqrt(32),
        SPEC=spec,
        num_warps=num_warps,
    )
    if rowwise:
        args.update(stride_m=x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
        kernel, grid = _grid_rows_kernel, (cdiv(M, block_m), cdiv(N, block_n))
    else:
        args.update(STRIDE_M=x.stride(0), BLOCK_N=block_n)
        kernel, grid = _grid_cols_kernel, (M // 32, cdiv(N, block_n))
    return kernel, grid, args, MXTensor(data, scales, "mxfp4", 1 if rowwise else 0, 32, x.shape)


def quantize_grid_triton(x: torch.Tensor, **options) -> MXTensor:
    """``quantize_mx(grid_hadamard_transform(x, axis=axis, signs=signs), axis=axis, ...)``, fused."""
    kernel, grid, args, out = grid_launch(x, **options)
    kernel[grid](**args)
    return out
