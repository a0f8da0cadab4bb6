"""Triton GEMMs ``C = A @ B.T`` reading packed MXFP4 operands (blocks along K) directly.

Two kernels, both measured against the fold route (see ``adahop.bench.gemm``):

- ``mxfp4_fp8_matmul``: decodes E2M1 nibbles to E4M3 in registers, runs one FP8 ``tl.dot``
  per 32-wide scale block and promotes each partial product into a float32 accumulator with
  that block's two scales (DeepGEMM's promotion, at MX granularity). A block's partial sum is
  exact in the tensor core's accumulator (at most 32 * 36 in steps of 1/4), so the result is as
  accurate as float32 accumulation.
- ``mxfp4_dot_scaled_matmul``: ``tl.dot_scaled`` e2m1 x e2m1. On Hopper Triton upcasts both
  operands to BF16 inside the kernel, so it runs at BF16 tensor-core speed at best.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import MXTensor
from .launch import INTERPRET
from .mx_math import e2m1_to_e4m3, e8m0_to_fp32, unpack_fp4

MX_BLOCK = 32  # the kernels promote once per 32-element scale block
_MX = tl.constexpr(MX_BLOCK)
OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# Hopper tiles. Each 32-wide block needs a fresh partial product next to the accumulator, so a
# 128x128 tile wants two warpgroups (8 warps) to keep both in registers without spilling.
_FP8_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
    for bm, bn, bk, s, w in [
        (128, 128, 64, 4, 8),
        (128, 128, 128, 3, 8),
        (128, 128, 128, 4, 8),
        (64, 128, 128, 4, 4),
    ]
]
_DOT_SCALED_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=3, num_warps=8)
    for bk in (128, 256)
]
# The interpreter cannot autotune (no device to time on): one small tile, many rows per program.
_INTERPRET_META = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}


def _autotune(configs: list[triton.Config]):
    """``triton.autotune`` keyed on the problem shape, or nothing under the interpreter."""

    def wrap(kernel):
        return kernel if INTERPRET else triton.autotune(configs=configs, key=["M", "N", "K"])(kernel)

    return wrap


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's rows and columns of C and their bounds masks. Grouped ordering: consecutive
    programs share B tiles in L2 (the Triton matmul tutorial's)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@_autotune(_FP8_CONFIGS)
@triton.jit
def _mxfp4_fp8_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n_blocks = K // _MX
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * (K // 2)
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * (K // 2)
    a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * n_blocks
    b_scale_rows = b_scale_ptr + offs_n.to(tl.int64) * n_blocks
    half = tl.arange(0, _MX // 2)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // _MX):
            blk = k0 // _MX + j
            byte = blk * (_MX // 2) + half
            a_bytes = tl.load(a_rows + byte, mask=m_ok[:, None] & (byte < K // 2), other=0)
            b_bytes = tl.load(b_rows + byte, mask=n_ok[:, None] & (byte < K // 2), other=0)
            a8 = e2m1_to_e4m3(unpack_fp4(a_bytes)).to(tl.float8e4nv, bitcast=True)
            b8 = e2m1_to_e4m3(unpack_fp4(b_bytes)).to(tl.float8e4nv, bitcast=True)
            partial = tl.dot(a8, tl.trans(b8))
            # Past K the partial product is exactly 0: any in-bounds scale will do (a NaN one
            # there means the row's last block is NaN, so the row is NaN anyway).
            last = tl.minimum(blk, n_blocks - 1)
            sa = e8m0_to_fp32(tl.load(a_scale_rows + last, mask=m_ok, other=127))
            sb = e8m0_to_fp32(tl.load(b_scale_rows + last, mask=n_ok, other=127))
            acc += partial * sa[:, None] * sb[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(OUT_DTYPE), mask=m_ok[:, None] & n_ok[None, :])


@_autotune(_DOT_SCALED_CONFIGS)
@triton.jit
def _mxfp4_dot_scaled_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n_blocks = K // _MX
    half = tl.arange(0, BLOCK_K // 2)
    blk = tl.arange(0, BLOCK_K // _MX)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 // 2 + half < K // 2
        s_ok = k0 // _MX + blk < n_blocks
        # lhs [BLOCK_M, BLOCK_K/2] and rhs [BLOCK_K/2, BLOCK_N], both packed along K.
        a = tl.load(
            a_ptr + offs_m.to(tl.int64)[:, None] * (K // 2) + (k0 // 2 + half)[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0,
        )
        b = tl.load(
            b_ptr + offs_n.to(tl.int64)[None, :] * (K // 2) + (k0 // 2 + half)[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0,
        )
        sa = tl.load(
            a_scale_ptr + offs_m.to(tl.int64)[:, None] * n_blocks + k0 // _MX + blk,
            mask=m_ok[:, None] & s_ok,
            other=127,
        )
        sb = tl.load(
            b_scale_ptr + offs_n.to(tl.int64)[:, None] * n_blocks + k0 // _MX + blk,
            mask=n_ok[:, None] & s_ok,
            other=127,
        )
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
    c = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(OUT_DTYPE), mask=m_ok[:, None] & n_ok[None, :])


def _launch(kernel, a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.block_size != MX_BLOCK or b.block_size != MX_BLOCK:
        raise ValueError(f"the Triton MXFP4 GEMMs need block_size={MX_BLOCK}, got {a.block_size}, {b.block_size}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"unsupported out_dtype {out_dtype}; choose one of {tuple(OUT_DTYPES)}")
    M, N, K = a.data.shape[0], b.data.shape[0], 2 * a.data.shape[1]
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    meta = _INTERPRET_META if INTERPRET else {}
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)
    kernel[grid](
        a.data.contiguous(),
        a.scales.contiguous(),
        b.data.contiguous(),
        b.scales.contiguous(),
        c,
        M,
        N,
        K,
        OUT_DTYPE=OUT_DTYPES[out_dtype],
        **meta,
    )
    return c


def mxfp4_fp8_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``A @ B.T`` on FP8 tensor cores with per-32 scale promotion (operands checked by the caller)."""
    return _launch(_mxfp4_fp8_kernel, a, b, out_dtype)


def mxfp4_dot_scaled_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``A @ B.T`` through ``tl.dot_scaled`` e2m1 x e2m1 (operands checked by the caller)."""
    return _launch(_mxfp4_dot_scaled_kernel, a, b, out_dtype)
