"""Row-wise scaled FP8 quantization (``formats.rowwise``) as a Triton kernel, bit for bit.

One program takes ``BLOCK_R`` rows. A row of at most ``ONE_PASS_MAX`` elements is read once and held
in registers; longer rows are walked twice in ``BLOCK_K`` chunks. The row's abs-max (NaN kept) gives
its power-of-two scale; each element is divided by it (an exact multiply) and written as an E4M3 code with ``mx_math.encode_elements``, integer and magic-number
arithmetic that rounds to nearest even exactly as the reference does (the interpreter's
``.to(tl.float8e4nv)`` neither rounds to even nor saturates). The row's abs-max is also its
outlier score (``policy.selection.row_scores``), returned when asked for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.elements import E4M3
from ..formats.rowwise import (
    E4M3_NAN_CODE,
    MAX_SCALE_EXP,
    MIN_SCALE_EXP,
    ROWWISE_K_ALIGN,
    RowwiseFP8,
)
from .launch import INTERPRET, cdiv
from .mx_math import encode_elements, exp2_int, max_keeping_nan

_E4M3_MAX_CODE = tl.constexpr(0x7E)  # 448
_E4M3_SIGN = tl.constexpr(0x80)
_NAN_CODE = tl.constexpr(E4M3_NAN_CODE)
_F32_NAN_BITS = tl.constexpr(0x7FC00000)
_MIN_S = tl.constexpr(MIN_SCALE_EXP)
_MAX_S = tl.constexpr(MAX_SCALE_EXP)
_MBITS = tl.constexpr(E4M3.mbits)
_EMIN = tl.constexpr(E4M3.emin)


@triton.jit
def _quantize_rowwise_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    score_ptr,
    n_rows,
    K,
    K_PADDED,
    stride_x,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
    SCORES: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    if ONE_PASS:  # the whole row in registers: one read
        cols = tl.arange(0, BLOCK_K)[None, :]
        row = tl.load(x_rows + cols, mask=row_ok[:, None] & (cols < K), other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(row), 1, max_keeping_nan)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            v = tl.load(x_rows + cols, mask=row_ok[:, None] & (cols < K), other=0.0).to(tl.float32)
            amax = max_keeping_nan(amax, tl.reduce(tl.abs(v), 1, max_keeping_nan))

    # s: the smallest with amax <= 448 * 2**s (formats.rowwise.rowwise_scale_exponent), from bits.
    bits = amax.to(tl.int32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    s = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    s = tl.where(amax == 0.0, 0, tl.minimum(tl.maximum(s, _MIN_S), _MAX_S))
    s = tl.where(finite, s, 0)
    inv_scale = exp2_int(-s)[:, None]
    limit = tl.full([BLOCK_R, 1], _E4M3_MAX_CODE, tl.uint32)
    sign_weight = tl.full([BLOCK_R, 1], _E4M3_SIGN, tl.uint32)
    out_rows = data_ptr + rows.to(tl.int64)[:, None] * K_PADDED
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_K)[None, :]
        codes = encode_elements(row * inv_scale, 0, limit, sign_weight, False, _MBITS, _EMIN)
        codes = tl.where(finite[:, None], codes, _NAN_CODE)
        tl.store(out_rows + cols, codes.to(tl.uint8), mask=row_ok[:, None] & (cols < K_PADDED))
    else:
        for k0 in range(0, K_PADDED, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)[None, :]
            v = tl.load(x_rows + cols, mask=row_ok[:, None] & (cols < K), other=0.0).to(tl.float32)
            codes = encode_elements(v * inv_scale, 0, limit, sign_weight, False, _MBITS, _EMIN)
            codes = tl.where(finite[:, None], codes, _NAN_CODE)
            tl.store(out_rows + cols, codes.to(tl.uint8), mask=row_ok[:, None] & (cols < K_PADDED))
    scale_bits = tl.where(finite, (s + 127) << 23, _F32_NAN_BITS)
    tl.store(scale_ptr + rows, scale_bits, mask=row_ok)
    if SCORES:
        tl.store(score_ptr + rows, amax, mask=row_ok)


ONE_PASS_MAX = 16384  # longest row (padded to a power of two) held in registers
ELEMENTS_PER_WARP = 1024  # a one-pass program's warps: 32 float32 values per thread


def quantize_fp8_rowwise_triton(
    x: torch.Tensor, *, scores: bool = False, block_r: int | None = None, block_k: int | None = None
) -> RowwiseFP8 | tuple[RowwiseFP8, torch.Tensor]:
    """``formats.rowwise.quantize_fp8_rowwise`` of a 2-D tensor with unit column stride, on CUDA
    (or under ``TRITON_INTERPRET=1``); ``scores``: also each row's abs-max (float32, NaN kept).
    ``block_k`` below the padded row length walks rows in two passes (default: one pass where it fits)."""
    if not (x.device.type == "cuda" or INTERPRET):
        raise RuntimeError(f"quantize_fp8_rowwise_triton runs on CUDA (or TRITON_INTERPRET=1), got {x.device}")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"expected a 2-D float32, bfloat16 or float16 tensor, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_rows, k = x.shape
    k_padded = -(-k // ROWWISE_K_ALIGN) * ROWWISE_K_ALIGN
    data = torch.empty(n_rows, k_padded, dtype=torch.uint8, device=x.device)
    row_scale = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    score = torch.empty(n_rows if scores else 0, dtype=torch.float32, device=x.device)
    whole_row = triton.next_power_of_2(k_padded)
    block_k = min(block_k or ONE_PASS_MAX, whole_row)
    one_pass = block_k == whole_row
    # The interpreter pays per program; on the GPU a program holds about 4096 elements.
    block_r = block_r or (16 if INTERPRET else max(1, 4096 // block_k))
    warps = min(16, max(4, block_r * block_k // ELEMENTS_PER_WARP))
    _quantize_rowwise_kernel[(cdiv(n_rows, block_r),)](
        x,
        data,
        row_scale.view(torch.int32),
        score,
        n_rows,
        k,
        k_padded,
        x.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        ONE_PASS=one_pass,
        SCORES=scores,
        num_warps=warps,
    )
    q = RowwiseFP8(data.view(torch.float8_e4m3fn), row_scale)
    return (q, score) if scores else q
