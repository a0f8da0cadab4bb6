"""Row-wise (Hadamard +) MXFP4 quantization that writes the folded E4M3 operand directly.

An operand that the next GEMM consumes right away (forward X and W, dgrad's dY) never needs its
packed MXFP4 form: ``quantize_fold_fp8(x)`` equals, bit for bit,
``fold_to_fp8_reference(quantize_mx(hadamard_transform(x) if hb else x, ...))`` and skips the
packed write, the separate fold launch and its read. Operands saved for backward stay packed
MXFP4 (that is where the memory saving is) and are folded when their GEMM runs.

A fold needs each row's largest block exponent, so one program holds whole rows: ``BLOCK_N`` is
the row length rounded up to a power of two, a thread keeps its blocks as in the row-wise
quantize kernel (``quantize.row_blocks``), and the row maximum of the E8M0 codes is one
reduction across the program before the codes are folded and stored.
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
from .fold import FLUSH_SHIFT, FOLD_OFFSET, _fold_nibbles
from .launch import INTERPRET, cdiv
from .quantize import common_constexprs, seed_pointer, zero_seed
from .quantize_blocks import row_blocks, row_codes

ELEMENTS_PER_THREAD = 32  # one block per thread, as in the row-wise quantize kernel
MAX_WARPS = 16
INTERPRETER_ROWS = 16  # the interpreter pays per program: many rows each

_OFFSET = tl.constexpr(FOLD_OFFSET)
_FLUSH = tl.constexpr(FLUSH_SHIFT)
_E4M3_NAN = tl.constexpr(0x7F)


@triton.jit
def _store_folded(out_ptr, codes, shift, nan, ok, offs):
    """Fold one slice's codes by its blocks' ``shift`` and store the E4M3 bytes; returns the
    number of elements per row that lost bits (none in NaN or masked blocks)."""
    bits, lossy = _fold_nibbles(codes, shift)
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
    NB: tl.constexpr = BLOCK_N // 32
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, NB)
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
    # Philox counters as in the packed layout (word w holds elements 8w..8w+7), so the noise,
    # and so the codes, are those of quantize_mx_triton.
    word0 = rows.to(tl.int64)[:, None] * (N // 8) + (blocks * 4)[None, :]
    c0 = row_codes(v0, inv_scale, limit, sign_weight, word0, seed, STOCHASTIC, MBITS, EMIN)
    c1 = row_codes(v1, inv_scale, limit, sign_weight, word0 + 1, seed, STOCHASTIC, MBITS, EMIN)
    c2 = row_codes(v2, inv_scale, limit, sign_weight, word0 + 2, seed, STOCHASTIC, MBITS, EMIN)
    c3 = row_codes(v3, inv_scale, limit, sign_weight, word0 + 3, seed, STOCHASTIC, MBITS, EMIN)

    # The row's reference: its largest finite block code (NaN blocks and blocks past N left out).
    row_ok = rows < M
    valid = row_ok[:, None] & (blocks < N // 32)[None, :]
    codes = scale_codes.to(tl.int32)
    nan_block = codes == 255
    ref = tl.max(tl.where(valid & ~nan_block, codes, 0), axis=1)
    shift = tl.maximum(codes - ref[:, None] + _OFFSET, _FLUSH)[:, :, None]
    nan, ok = nan_block[:, :, None], valid[:, :, None]
    offs = rows.to(tl.int64)[:, None, None] * N + (blocks * 32)[None, :, None] + tl.arange(0, 8)[None, None, :]
    lossy = _store_folded(out_ptr, c0, shift, nan, ok, offs)
    lossy += _store_folded(out_ptr, c1, shift, nan, ok, offs + 8)
    lossy += _store_folded(out_ptr, c2, shift, nan, ok, offs + 16)
    lossy += _store_folded(out_ptr, c3, shift, nan, ok, offs + 24)

    # 2**(ref - 127 - FOLD_OFFSET) from bits; a subnormal float32 when the biased exponent is <= 0.
    scale_exp = ref - _OFFSET
    scale_bits = tl.where(scale_exp > 0, scale_exp << 23, 1 << (22 + scale_exp))
    tl.store(row_scale_ptr + rows, scale_bits, mask=row_ok)
    tl.store(lossy_ptr + rows, lossy, mask=row_ok)
    if SCORES:  # a program holds whole rows
        tl.store(score_ptr + rows, score, mask=row_ok)


@functools.lru_cache(maxsize=1024)
def _tile(n: int, on_cuda: bool) -> tuple[int, int, int]:
    """(rows per program, BLOCK_N, warps) for rows of ``n`` elements."""
    block_n = triton.next_power_of_2(n)
    if not on_cuda:
        return INTERPRETER_ROWS, block_n, 1
    warps = max(1, min(MAX_WARPS, block_n // (32 * ELEMENTS_PER_THREAD)))
    return 1, block_n, warps


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
        HADAMARD=hadamard_block_size,
        num_warps=warps,
        **common_constexprs(x.dtype, x.is_cuda, "mxfp4", scale_rule, rounding, signs is not None, scores),
    )
    folded = FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)
    return (folded, score) if scores else folded
