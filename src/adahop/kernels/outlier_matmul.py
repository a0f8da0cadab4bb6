"""The high-precision path of outlier extraction: ``a @ b.T`` written straight into the output.

Under OE the k extracted rows of one operand are multiplied in BF16 with the other, dense
operand, and the products replace k rows (OE-left) or k columns (OE-right) of the MXFP4 GEMM's
output. One kernel does both: it reads the dense operand once (the memory floor of this path),
accumulates in FP32 and stores each tile at its scattered rows or columns, so there is no
separate result tensor and no index_put pass. Operands may be transposed views (any strides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .mx_triton import INTERPRET, cdiv


@dataclass(frozen=True)
class OutlierTiling:
    """Tile sides along the extracted rows, the dense operand's rows and K, and pipeline depth."""

    extracted: int
    dense: int
    block_k: int
    num_stages: int
    num_warps: int = 4


# Per output side, the fastest of a same-run H200 comparison at the Llama-3-8B shapes (k = 64,
# 16k tokens; benchmarks/results/2026-12-03-h200-oe-tilings.json). Narrow dense tiles give
# OE-left (grid over N only) enough programs; OE-right has 256 programs of 64 tokens.
TILINGS = {
    0: OutlierTiling(extracted=64, dense=32, block_k=128, num_stages=4),  # OE-left: rows of C
    1: OutlierTiling(extracted=64, dense=64, block_k=128, num_stages=3),  # OE-right: columns of C
}
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _outlier_matmul_kernel(
    a_ptr, b_ptr, out_ptr, index_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    INDEXED_ROWS: tl.constexpr,  # out[index[i], j] (OE-left), else out[i, index[j]] (OE-right)
    UPCAST: tl.constexpr,  # the interpreter's tl.dot needs float32 operands
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_tile = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_tile = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = offs_k + k0 < K
        a = tl.load(a_tile, mask=mask_m[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_tile, mask=in_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk

    if INDEXED_ROWS:
        rows = tl.load(index_ptr + offs_m, mask=mask_m, other=0)
        cols = offs_n
    else:
        rows = offs_m
        cols = tl.load(index_ptr + offs_n, mask=mask_n, other=0)
    dst = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel serves these operands (16-bit floats of one dtype, on CUDA or interpreted)."""
    return (a.is_cuda or INTERPRET) and a.dtype == b.dtype and a.dtype in DTYPES


def outlier_matmul_triton(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    """Write ``a @ b.T`` into ``out``: into rows ``index`` (``dim=0``; ``a`` holds the extracted
    rows) or columns ``index`` (``dim=1``; ``b`` holds them). FP32 accumulation, rounded once."""
    (m, k), n = a.shape, b.shape[0]
    tiling = TILINGS[dim]
    block_m, block_n = (tiling.extracted, tiling.dense) if dim == 0 else (tiling.dense, tiling.extracted)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _outlier_matmul_kernel[grid](
        a, b, out, index, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        INDEXED_ROWS=dim == 0, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps, num_stages=1 if INTERPRET else tiling.num_stages,
    )
