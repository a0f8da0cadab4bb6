"""Row-wise (Hadamard +) MXFP4 quantization that writes the folded E4M3 operand directly.

An operand that the next GEMM consumes right away (forward X and W, dgrad's dY) never needs its
packed MXFP4 form: ``quantize_fold_fp8(x)`` equals, bit for bit,
``fold_to_fp8_reference(quantize_mx(hadamard_transform(x) if hb else x, ...))`` and skips the
packed write, the separate fold launch and its read. Operands saved for backward stay packed
MXFP4 (that is where the memory saving is) and are folded when their GEMM runs.

A fold needs each row's largest block exponent, so one program holds whole rows: ``BLOCK_N`` is
the row length rounded up to a power of two, a thread keeps its blocks as in the row-wise
quantize kernel (``quantize.row_blocks``), and the row maximum of the E8M0 codes is one
reduction across the program before the codes are folded and stored. Where every block of the
program folds into a normal E4M3 number (the common case), the E4M3 pattern is a multiply-add
of the magnitude code; otherwise the program takes the exact path of ``kernels.fold``, which
rounds onto E4M3's subnormal grid and counts the elements that lose bits.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..formats.folded import FOLD_BLOCK, FoldedFP8, folds_directly
from ..formats.mx import check_quantize_args
from ..transforms.hadamard import check_hadamard_args
from .fold import _MIN_NORMAL_SHIFT, FLUSH_SHIFT, FOLD_OFFSET, _fold_nibbles
from .launch import INTERPRET, cdiv, quantize_spec, seed_pointer, zero_seed
from .quantize_blocks import row_blocks, row_codes, slice_noise

ELEMENTS_PER_THREAD = 32  # one block per thread, as in the row-wise quantize kernel
MAX_WARPS = 16
# ptxas' per-thread register cap: the exact path would otherwise set the register count (and cap
# the occupancy) of the common path; at 80 the common path does not spill (benchmarks/quantize/2026-12-04-h200-quantize-kernels/).
MAX_REGISTERS = 80
INTERPRETER_ROWS = 16  # the interpreter pays per program: many rows each

_OFFSET = tl.constexpr(FOLD_OFFSET)
_FLUSH = tl.constexpr(FLUSH_SHIFT)
_E4M3_NAN = tl.constexpr(0x7F)
_E4M3_SIGN = tl.constexpr(0x80)


@triton.jit
def sign_bit(v):
    """1 where float32 ``v`` has its sign bit set (-0.0 included), else 0 (uint32)."""
    return v.to(tl.uint32, bitcast=True) >> 31


@triton.jit
def _store_folded_normal(out_ptr, magnitudes, negative, exp_bits, sign_bits, nan_bits, ok, offs):
    """Store one slice folded where every block of the program stays a normal E4M3 number.

    An E2M1 magnitude code ``m = 2 * e + mantissa`` (m >= 2) times ``2**shift`` is the E4M3
    pattern ``4 * m + exp_bits`` with ``exp_bits = 8 * (shift + 6)``; 0.5 (m = 1) is
    ``exp_bits`` itself and zero stays zero. Multiply-adds and one select, no rounding: these
    values are exact. A NaN block (its magnitudes all 0) stores ``nan_bits`` (0x7F), and its
    ``sign_bits`` is 0.
    """
    bits = tl.where(magnitudes < 2, magnitudes * exp_bits + nan_bits, magnitudes * 4 + exp_bits)
    bits += negative * sign_bits
    tl.store(out_ptr + offs, bits.to(tl.uint8), mask=ok)


@triton.jit
def _store_folded_exact(out_ptr, magnitudes, negative, sign_weight, shift, nan, ok, offs):
    """Store one slice folded with blocks below E4M3's normal range rounded onto its subnormal
    grid; returns the number of elements per row that lost bits (none in NaN or masked blocks)."""
    bits, lossy = _fold_nibbles(magnitudes + negative * sign_weight, shift)
    bits = tl.where(nan, _E4M3_NAN, bits)
    tl.store(out_ptr + offs, bits.to(tl.uint8), mask=ok)
    return tl.sum(tl.sum((lossy & ok & ~nan).to(tl.int32), axis=2), axis=1)


@triton.jit
def _quantize_fold_rows_kernel(
    x_ptr,
    signs_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    score_ptr,
    M,
    N,
    stride_m,
    seed_ptr,
    hadamard_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_N // 32
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, NB)
    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score = row_blocks(
        x_ptr, signs_ptr, rows, blocks, M, N, stride_m, hadamard_scale, SPEC
    )
    # Magnitude codes (sign weight 0), with Philox counters as in the packed layout (call c draws
    # the noise of elements 16c..16c+15), so the noise, and so the codes, are those of quantize_mx_triton.
    call0 = rows.to(tl.int64)[:, None] * (N // 16) + (blocks * 2)[None, :]
    noise0, noise1 = slice_noise(seed, call0, SPEC)
    m0 = row_codes(v0, inv_scale, limit, 0, noise0, SPEC)
    m1 = row_codes(v1, inv_scale, limit, 0, noise1, SPEC)
    noise2, noise3 = slice_noise(seed, call0 + 1, SPEC)
    m2 = row_codes(v2, inv_scale, limit, 0, noise2, SPEC)
    m3 = row_codes(v3, inv_scale, limit, 0, noise3, SPEC)
    n0, n1, n2, n3 = sign_bit(v0), sign_bit(v1), sign_bit(v2), sign_bit(v3)

    # The row's reference: its largest finite block code (NaN blocks and blocks past N left out).
    row_ok = rows < M
    valid = row_ok[:, None] & (blocks < N // 32)[None, :]
    codes = scale_codes.to(tl.int32)
    nan_block = codes == 255
    counted = valid & ~nan_block
    ref = tl.max(tl.where(counted, codes, 0), axis=1)
    shift = codes - ref[:, None] + _OFFSET
    offs = rows.to(tl.int64)[:, None, None] * N + (blocks * 32)[None, :, None] + tl.arange(0, 8)[None, None, :]
    ok = valid[:, :, None]
    # One decision per program keeps the common case free of rounding work and reductions.
    if tl.min(tl.where(counted, shift, _OFFSET)) >= _MIN_NORMAL_SHIFT:
        exp_bits = ((shift + _OFFSET) * 8)[:, :, None]
        sign_bits = (sign_weight * (_E4M3_SIGN // 8)).to(tl.int32)  # 0x80, or 0 in a NaN block
        nan_bits = tl.where(nan_block, _E4M3_NAN, 0)[:, :, None]
        _store_folded_normal(out_ptr, m0.to(tl.int32), n0, exp_bits, sign_bits, nan_bits, ok, offs)
        _store_folded_normal(out_ptr, m1.to(tl.int32), n1, exp_bits, sign_bits, nan_bits, ok, offs + 8)
        _store_folded_normal(out_ptr, m2.to(tl.int32), n2, exp_bits, sign_bits, nan_bits, ok, offs + 16)
        _store_folded_normal(out_ptr, m3.to(tl.int32), n3, exp_bits, sign_bits, nan_bits, ok, offs + 24)
        lossy = tl.zeros([BLOCK_M], dtype=tl.int32)
    else:
        flushed = tl.maximum(shift, _FLUSH)[:, :, None]
        nan = nan_block[:, :, None]
        lossy = _store_folded_exact(out_ptr, m0, n0, sign_weight, flushed, nan, ok, offs)
        lossy += _store_folded_exact(out_ptr, m1, n1, sign_weight, flushed, nan, ok, offs + 8)
        lossy += _store_folded_exact(out_ptr, m2, n2, sign_weight, flushed, nan, ok, offs + 16)
        lossy += _store_folded_exact(out_ptr, m3, n3, sign_weight, flushed, nan, ok, offs + 24)

    # 2**(ref - 127 - FOLD_OFFSET) from bits; a subnormal float32 when the biased exponent is <= 0.
    scale_exp = ref - _OFFSET
    scale_bits = tl.where(scale_exp > 0, scale_exp << 23, 1 << (22 + scale_exp))
    tl.store(row_scale_ptr + rows, scale_bits, mask=row_ok)
    tl.store(lossy_ptr + rows, lossy, mask=row_ok)
    if SPEC.scores:  # a program holds whole rows
        tl.store(score_ptr + rows, score, mask=row_ok)


@functools.lru_cache(maxsize=1024)
def _tile(n: int, on_cuda: bool) -> tuple[int, int, int]:
    """(rows per program, BLOCK_N, warps) for rows of ``n`` elements."""
    block_n = triton.next_power_of_2(n)
    if not on_cuda:
        return INTERPRETER_ROWS, block_n, 1
    # At least a warp's worth of blocks per program: rows shorter than 32 blocks share one.
    rows = max(1, 32 * ELEMENTS_PER_THREAD // block_n)
    warps = max(1, min(MAX_WARPS, rows * block_n // (32 * ELEMENTS_PER_THREAD)))
    return rows, block_n, warps


def quantize_fold_fp8(
    x: torch.Tensor,
    *,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
) -> FoldedFP8 | tuple[FoldedFP8, torch.Tensor]:
    """MXFP4 quantization of [M, K] ``x`` along K (after the 32-point Hadamard if asked), folded
    into E4M3 data and per-row scales in one kernel; ``scores``: also each row's outlier score
    (``policy.selection.row_scores``, float32) from the same read."""
    check_quantize_args(x, "mxfp4", FOLD_BLOCK, scale_rule, rounding)
    if not folds_directly(x, fmt="mxfp4", block_size=FOLD_BLOCK, hadamard_block_size=hadamard_block_size):
        raise ValueError(
            f"quantize_fold_fp8 takes a row-major 2-D tensor whose rows are whole blocks of {FOLD_BLOCK} and "
            f"hadamard_block_size 0 or {FOLD_BLOCK}; got shape {tuple(x.shape)}, strides {x.stride()}, "
            f"hadamard_block_size {hadamard_block_size}"
        )
    if hadamard_block_size:
        check_hadamard_args(x.shape[1], hadamard_block_size, signs)
    if not (x.is_cuda or INTERPRET):
        raise RuntimeError("quantize_fold_fp8 runs on CUDA (or under TRITON_INTERPRET=1); use the reference")
    M, N = x.shape
    block_m, block_n, warps = _tile(N, x.is_cuda)
    data = torch.empty(M, N, dtype=torch.uint8, device=x.device)
    # Separate tensors, not views of one: a custom op's outputs may not alias each other.
    row_scale = torch.empty(M, dtype=torch.float32, device=x.device)
    lossy = torch.empty(M, dtype=torch.int32, device=x.device)
    score = torch.empty(M, dtype=torch.float32, device=x.device) if scores else None
    seed_ptr = seed_pointer(x.device, seed) if rounding == "stochastic" else zero_seed(x.device)
    _quantize_fold_rows_kernel[(cdiv(M, block_m),)](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        x if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous(),
        data,
        row_scale.view(torch.int32),
        lossy,
        score,
        M,
        N,
        x.stride(0),
        seed_ptr,
        1 / math.sqrt(hadamard_block_size) if hadamard_block_size else 1.0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPEC=quantize_spec(
            x.dtype,
            x.is_cuda,
            "mxfp4",
            block_size=FOLD_BLOCK,
            scale_rule=scale_rule,
            rounding=rounding,
            hadamard=hadamard_block_size,
            has_signs=signs is not None,
            scores=scores,
        ),
        num_warps=warps,
        maxnreg=MAX_REGISTERS,
    )
    folded = FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)
    return (folded, score) if scores else folded
