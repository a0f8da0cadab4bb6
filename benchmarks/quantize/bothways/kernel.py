"""One read of a bf16 [M, N] tensor, both operands out: the rows folded into E4M3 (``quantize_fold_fp8``'s
output) and the columns as packed MXFP4 (``quantize_mx_triton(axis=0)``'s), bit for bit, each with its own
rounding, key, Hadamard size and scores, as training quantizes X (forward and wgrad) and dY (dgrad and wgrad).

A folded row needs its reference exponent (the largest block scale of the whole row) before it can write a
byte, and a column block needs 32 rows. So a program owns 32 whole rows and walks them in ``BLOCK_N``-wide
chunks twice: the first pass quantizes each chunk column-wise (one block down each column, the column
kernel's own code, ``quantize_mxfp4.quantize_column_blocks``) and takes the row blocks' scales for the
reference (``quantize_blocks.row_blocks``); the second reads the chunks again, from L2 where the strip is
still there, and encodes, folds and stores the rows (``quantize_fold.store_folded_blocks``). The row-wise
Hadamard and block maxima are computed twice; DRAM is read once where the program's strip (32 x N x 2 bytes)
stays in L2 between its passes, which the resident programs' strips fill or outgrow at training shapes (33-50 MB at
N = 2048 and 200 MB at 8192 on 132 SMs, against 50 MB of L2). ``staged``: the first pass also encodes the rows
and stores them as packed MXFP4 (``quantize_mxfp4.store_row_words``), and the second folds those
(``quantize_fold.store_folded_codes``): a quarter of the bytes wait in L2, no second Hadamard, one more write.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from adahop.formats.folded import FOLD_BLOCK, FoldedFP8, folds_directly
from adahop.formats.mx import MXTensor, check_quantize_args, storage_shapes
from adahop.kernels.launch import INTERPRET, QuantizeSpec, cdiv, quantize_spec, seed_pointer, zero_seed
from adahop.kernels.mx_math import max_keeping_nan
from adahop.kernels.quantize_blocks import row_blocks
from adahop.kernels.quantize_fold import row_reference, store_folded_blocks, store_folded_codes, store_row_scales
from adahop.kernels.quantize_mxfp4 import quantize_column_blocks, store_row_words
from adahop.transforms.hadamard import check_hadamard_args

CUDA_BLOCK_N = 128  # a chunk is 32 x 128: one row block, or one column, per thread of 4 warps
INTERPRETER_BLOCK_N = 256  # the interpreter pays per chunk: wide ones


@triton.jit
def _fold_rows_and_cols_kernel(
    x_ptr,
    signs_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    row_score_ptr,
    col_data_ptr,
    col_scale_ptr,
    col_score_ptr,
    packed_ptr,
    packed_scale_ptr,
    M,
    N,
    m_padded,
    row_seed_ptr,
    col_seed_ptr,
    row_hadamard_scale,
    col_hadamard_scale,
    STRIDE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    STAGED: tl.constexpr,
    ROW_SPEC: tl.constexpr,
    COL_SPEC: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_N // 32
    r0 = tl.program_id(0) * 32
    rows = r0 + tl.arange(0, 32)
    row_seed = tl.load(row_seed_ptr)
    col_seed = tl.load(col_seed_ptr)
    chunks = tl.cdiv(N, BLOCK_N)
    # Pass 1: the column blocks of every chunk, and each row's reference exponent (and score); ``STAGED``: the
    # rows' packed MXFP4 too.
    ref = tl.zeros([32], dtype=tl.int32)
    score = tl.zeros([32], dtype=tl.float32)
    for chunk in range(chunks):
        cols = tl.max_contiguous(chunk * BLOCK_N + tl.arange(0, BLOCK_N), 1)  # one per thread
        quantize_column_blocks(
            x_ptr, signs_ptr, col_data_ptr, col_scale_ptr, col_score_ptr, r0, cols, M, N, m_padded, col_seed,
            col_hadamard_scale, STRIDE_M, MASKED, COL_SPEC,
        )  # fmt: skip
        blocks = chunk * NB + tl.arange(0, NB)
        v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, part_score = row_blocks(
            x_ptr, signs_ptr, rows, blocks, M, N, STRIDE_M, row_hadamard_scale, ROW_SPEC
        )
        if STAGED:
            store_row_words(
                v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, rows, blocks, M, N, row_seed, packed_ptr,
                packed_scale_ptr, ROW_SPEC,
            )  # fmt: skip
        ref = tl.maximum(ref, row_reference(scale_codes, rows, blocks, M, N))
        if ROW_SPEC.scores:
            score = max_keeping_nan(score, part_score)
    # Pass 2: the rows folded against their references, from the source again or from the packed rows.
    if STAGED:
        tl.debug_barrier()  # the packed rows another warp of this program stored are visible
    lossy = tl.zeros([32], dtype=tl.int32)
    for chunk in range(chunks):
        blocks = chunk * NB + tl.arange(0, NB)
        if STAGED:
            part_lossy = _fold_packed_blocks(packed_ptr, packed_scale_ptr, ref, rows, blocks, M, N, out_ptr)
        else:
            v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, _ = row_blocks(
                x_ptr, signs_ptr, rows, blocks, M, N, STRIDE_M, row_hadamard_scale, ROW_SPEC
            )
            _, part_lossy = store_folded_blocks(
                v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, ref, rows, blocks, M, N, row_seed,
                out_ptr, ROW_SPEC,
            )  # fmt: skip
        lossy += part_lossy
    store_row_scales(ref, lossy, score, rows, M, row_scale_ptr, lossy_ptr, row_score_ptr, ROW_SPEC)


@triton.jit
def _nibbles(word):
    """The eight 4-bit codes of each 32-bit word of ``word`` [R, NB], first lowest: [R, NB, 8] (uint32)."""
    return (word.to(tl.uint32, bitcast=True)[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF


@triton.jit
def _fold_packed_blocks(packed_ptr, packed_scale_ptr, ref, rows, blocks, M, N, out_ptr):
    """``store_folded_codes`` of ``blocks`` of ``rows`` read back from their packed MXFP4 (as ``store_row_words``
    wrote them: a code's bit 3 is its sign, 0 in a NaN block); returns each row's lossy count."""
    R: tl.constexpr = rows.shape[0]
    NB: tl.constexpr = blocks.shape[0]
    n_blocks = N // 32
    ok = (rows < M)[:, None] & (blocks < n_blocks)[None, :]
    word0 = rows.to(tl.int64)[:, None] * (N // 8) + (blocks * 4)[None, :]
    words = tl.load(packed_ptr + word0[:, :, None] + tl.arange(0, 4)[None, None, :], mask=ok[:, :, None], other=0)
    even, odd = tl.split(tl.reshape(words, [R, NB, 2, 2]))  # (w0, w2), (w1, w3)
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    scale_codes = tl.load(packed_scale_ptr + rows.to(tl.int64)[:, None] * n_blocks + blocks[None, :], mask=ok, other=0)
    sign_weight = tl.where(scale_codes != 255, 8, 0).to(tl.uint32)[:, :, None]
    c0, c1, c2, c3 = _nibbles(w0), _nibbles(w1), _nibbles(w2), _nibbles(w3)
    _, lossy = store_folded_codes(
        c0 & 7, c1 & 7, c2 & 7, c3 & 7, c0 >> 3, c1 >> 3, c2 >> 3, c3 >> 3, sign_weight, scale_codes, ref, rows,
        blocks, M, N, out_ptr,
    )  # fmt: skip
    return lossy


class RowsAndCols(NamedTuple):
    """The two operands, and the scores asked for (else None)."""

    folded: FoldedFP8  # rows, blocks along N, folded into E4M3: the forward's (dgrad's) L
    cols: MXTensor  # columns, blocks along M, packed MXFP4 (axis 0): wgrad's operand
    row_scores: torch.Tensor | None
    col_scores: torch.Tensor | None
    packed_rows: MXTensor | None  # ``staged``: the rows as packed MXFP4 (axis 1), what the fold read back


def _spec(x: torch.Tensor, scale_rule: str, rounding: str, hadamard: int, signs, scores: bool) -> QuantizeSpec:
    has_signs = signs is not None and hadamard > 0
    return quantize_spec(x.dtype, x.is_cuda, "mxfp4", FOLD_BLOCK, scale_rule, rounding, hadamard, has_signs, scores)


def quantize_fold_rows_and_cols(
    x: torch.Tensor,
    *,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    hadamard_block_size: int = 0,
    row_seed: int | torch.Tensor | None = None,
    col_seed: int | torch.Tensor | None = None,
    signs: torch.Tensor | None = None,
    row_scores: bool = False,
    col_scores: bool = False,
    col_rounding: str | None = None,
    col_hadamard_block_size: int | None = None,
    block_n: int | None = None,
    staged: bool = False,
) -> RowsAndCols:
    """``quantize_fold_fp8(x, rounding, seed=row_seed, hadamard_block_size, scores=row_scores)`` and
    ``quantize_mx_triton(x, axis=0, rounding=col_rounding, seed=col_seed, hadamard_block_size=col_hadamard_block_size,
    scores=col_scores)`` (the column options default to the row ones) from one read of ``x``. ``staged``: the first
    pass also writes the rows as packed MXFP4, and the second folds those (a quarter of the bytes to read back,
    no second Hadamard or encoding) instead of reading ``x`` again."""
    col_rounding = rounding if col_rounding is None else col_rounding
    col_hb = hadamard_block_size if col_hadamard_block_size is None else col_hadamard_block_size
    check_quantize_args(x, "mxfp4", FOLD_BLOCK, scale_rule, rounding)
    check_quantize_args(x, "mxfp4", FOLD_BLOCK, scale_rule, col_rounding)
    fits = all(folds_directly(x, fmt="mxfp4", block_size=FOLD_BLOCK, hadamard_block_size=hb) for hb in (hadamard_block_size, col_hb))  # fmt: skip
    if not fits:
        raise ValueError(
            f"quantize_fold_rows_and_cols takes a row-major 2-D tensor whose rows are whole blocks of {FOLD_BLOCK} "
            f"and Hadamard sizes 0 or {FOLD_BLOCK}; got shape {tuple(x.shape)}, strides {x.stride()}, "
            f"hadamard_block_size {hadamard_block_size}, col_hadamard_block_size {col_hb}"
        )
    M, N = x.shape
    if hadamard_block_size:
        check_hadamard_args(N, hadamard_block_size, signs)
    if col_hb:
        check_hadamard_args(M, col_hb, signs)
    if not (x.is_cuda or INTERPRET):
        raise RuntimeError("quantize_fold_rows_and_cols runs on CUDA (or under TRITON_INTERPRET=1)")
    if block_n is None:
        block_n = CUDA_BLOCK_N if x.is_cuda else min(INTERPRETER_BLOCK_N, triton.next_power_of_2(N))
    if block_n & (block_n - 1) or block_n < 32:
        raise ValueError(f"block_n must be a power of two of at least 32 (a block per thread), got {block_n}")
    m_padded = cdiv(M, 32) * 32
    device = x.device
    data = torch.empty(M, N, dtype=torch.uint8, device=device)
    row_scale = torch.empty(M, dtype=torch.float32, device=device)
    lossy = torch.empty(M, dtype=torch.int32, device=device)
    row_score = torch.empty(M, dtype=torch.float32, device=device) if row_scores else None
    col_shapes = storage_shapes(N, M, "mxfp4", FOLD_BLOCK)
    col_data = torch.empty(col_shapes[0], dtype=torch.uint8, device=device)
    col_scales = torch.empty(col_shapes[1], dtype=torch.uint8, device=device)
    # Staged: the rows' packed MXFP4 (codes, E8M0 scales), written by the first pass and read by the second.
    packed = [torch.empty(shape, dtype=torch.uint8, device=device) for shape in storage_shapes(M, N, "mxfp4", 32)]
    packed = packed if staged else [None, None]
    # Zeros: each program raises a column's score to its block's abs-max (atomically, as float32 bits).
    col_score = torch.zeros(N, dtype=torch.float32, device=device) if col_scores else None

    def key(seed, which_rounding):
        return seed_pointer(device, seed) if which_rounding == "stochastic" else zero_seed(device)

    _fold_rows_and_cols_kernel[(cdiv(M, 32),)](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        x if signs is None else signs.to(device=device, dtype=torch.float32).contiguous(),
        data,
        row_scale.view(torch.int32),
        lossy,
        row_score,
        col_data.view(torch.int32),
        col_scales,
        None if col_score is None else col_score.view(torch.int32),
        packed[0].view(torch.int32) if staged else None,
        packed[1],
        M,
        N,
        m_padded,
        key(row_seed, rounding),
        key(col_seed, col_rounding),
        1 / math.sqrt(hadamard_block_size) if hadamard_block_size else 1.0,
        1 / math.sqrt(col_hb) if col_hb else 1.0,
        STRIDE_M=x.stride(0),
        BLOCK_N=block_n,
        MASKED=M % 32 != 0 or N % block_n != 0,
        STAGED=staged,
        ROW_SPEC=_spec(x, scale_rule, rounding, hadamard_block_size, signs, row_scores),
        COL_SPEC=_spec(x, scale_rule, col_rounding, col_hb, signs, col_scores),
        num_warps=block_n // 32 if x.is_cuda else 1,  # one row block, or one column, per thread
    )
    folded = FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)
    cols = MXTensor(col_data, col_scales, "mxfp4", 0, FOLD_BLOCK, x.shape)
    packed_rows = MXTensor(*packed, "mxfp4", 1, FOLD_BLOCK, x.shape) if staged else None
    return RowsAndCols(folded, cols, row_score, col_score, packed_rows)
