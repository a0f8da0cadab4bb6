"""SwiGLU's product ``F.silu(gate) * up`` computed and quantized straight into the folded FP8 operand of the next
GEMM (w2's X) in one pass, optionally also writing the bf16 product.

The product is eager PyTorch's, bit for bit: ``F.silu`` on bfloat16 computes ``g / (1 + exp(-g))`` in float32
and rounds to bfloat16, then ``* up`` multiplies in float32 (exact: two 8-bit significands) and rounds to
bfloat16. silu of a bf16 gate has only 65,536 possible inputs, so ``silu="table"`` (the default) looks it up
in eager's own results on the device (128 KB, exact by construction, a load per element); ``silu="math"``
computes it (CUDA's ``expf`` through libdevice, the same code as eager's, and an IEEE division: about 30 more
instructions per element). Everything after that is ``quantize_fold_fp8``'s own device code (``slice_blocks``
and ``store_folded_rows``), so the operand is ``quantize_fold_fp8(product)``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from adahop.kernels.quantize_fold import MAX_REGISTERS, quantize_fold_fp8

from .device import bf16_bits, bf16_value, quantize_fold_slices, slice_offsets
from .launch import Epilogue, prepare, result


SILU_METHODS = ("table", "math")


@functools.cache
def silu_table(device: torch.device) -> torch.Tensor:
    """Eager ``F.silu`` of every bf16 value on ``device``, as int16 bits indexed by the input's bits."""
    every = torch.arange(2**16, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)
    return F.silu(every).view(torch.int16)


@triton.jit
def silu_product(g_bits, u_bits, table_ptr, NATIVE: tl.constexpr):
    """bf16 bits of eager's ``F.silu(g) * u`` from the bf16 bits of ``g`` and ``u``; silu from
    ``silu_table`` where ``table_ptr`` is given, else computed."""
    if table_ptr is not None:
        silu = tl.load(table_ptr + g_bits.to(tl.uint16, bitcast=True).to(tl.int32))
    else:
        g = bf16_value(g_bits)
        if NATIVE:
            e = libdevice.exp(-g)  # CUDA's expf (tl.exp is the approximate ex2 path)
        else:
            e = tl.exp(-g)  # numpy's, which rounds silu to the same bf16 as eager CPU (checked over all bf16)
        silu = bf16_bits(tl.div_rn(g, 1.0 + e), NATIVE)
    u = bf16_value(u_bits)
    return bf16_bits(bf16_value(silu) * u, NATIVE)


@triton.jit
def _product_slice(gate_ptr, up_ptr, product_ptr, table_ptr, rows, blocks, M, N, k: tl.constexpr, WRITE: tl.constexpr,
                   NATIVE: tl.constexpr):  # fmt: skip
    offs, ok = slice_offsets(rows, blocks, M, N, N, k)
    g, u = tl.load(gate_ptr + offs, mask=ok, other=0), tl.load(up_ptr + offs, mask=ok, other=0)
    p = silu_product(g, u, table_ptr, NATIVE)
    if WRITE:
        tl.store(product_ptr + offs, p, mask=ok)
    return p  # +0 where masked: silu(+0) * +0, as quantize_fold_fp8's masked loads


@triton.jit
def _swiglu_quantize_fold_kernel(
    gate_ptr,
    up_ptr,
    product_ptr,
    table_ptr,
    signs_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    score_ptr,
    M,
    N,
    seed_ptr,
    hadamard_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
    WRITE_PRODUCT: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_N // 32
    NATIVE: tl.constexpr = SPEC.native_casts
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, NB)
    x0 = _product_slice(gate_ptr, up_ptr, product_ptr, table_ptr, rows, blocks, M, N, 0, WRITE_PRODUCT, NATIVE)
    x1 = _product_slice(gate_ptr, up_ptr, product_ptr, table_ptr, rows, blocks, M, N, 1, WRITE_PRODUCT, NATIVE)
    x2 = _product_slice(gate_ptr, up_ptr, product_ptr, table_ptr, rows, blocks, M, N, 2, WRITE_PRODUCT, NATIVE)
    x3 = _product_slice(gate_ptr, up_ptr, product_ptr, table_ptr, rows, blocks, M, N, 3, WRITE_PRODUCT, NATIVE)
    quantize_fold_slices(
        x0, x1, x2, x3, rows, blocks, M, N, seed, signs_ptr, hadamard_scale,
        out_ptr, row_scale_ptr, lossy_ptr, score_ptr, SPEC,
    )  # fmt: skip


def swiglu_quantize_fold(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
    write_product: bool = False,
    silu: str = "table",
) -> Epilogue:
    """``quantize_fold_fp8(F.silu(gate) * up, ...)`` for bf16 [M, N] ``gate`` (w1 x) and ``up`` (w3 x)
    in one kernel; ``write_product``: also the bf16 product (``Epilogue.output``); ``silu``: looked up
    in eager's results ("table") or computed ("math"), the same bits either way."""
    if silu not in SILU_METHODS:
        raise ValueError(f"silu must be one of {SILU_METHODS}, got {silu!r}")
    if gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.shape != up.shape:
        raise ValueError(
            f"swiglu_quantize_fold takes bf16 gate and up of one shape; got {gate.dtype} {tuple(gate.shape)} "
            f"and {up.dtype} {tuple(up.shape)}"
        )
    if not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError("swiglu_quantize_fold takes contiguous gate and up (call .contiguous())")
    launch = prepare(
        "swiglu_quantize_fold", gate, scale_rule=scale_rule, rounding=rounding, seed=seed,
        hadamard_block_size=hadamard_block_size, signs=signs, scores=scores, write_output=write_product,
    )  # fmt: skip
    M, N = gate.shape
    _swiglu_quantize_fold_kernel[(triton.cdiv(M, launch.block_m),)](
        gate.view(torch.int16),
        up.view(torch.int16),
        None if launch.output is None else launch.output.view(torch.int16),
        silu_table(gate.device) if silu == "table" else None,
        gate if launch.signs is None else launch.signs,
        launch.data,
        launch.row_scale.view(torch.int32),
        launch.lossy,
        launch.score,
        M,
        N,
        launch.seed_ptr,
        launch.hadamard_scale,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        SPEC=launch.spec,
        WRITE_PRODUCT=write_product,
        num_warps=launch.warps,
        maxnreg=MAX_REGISTERS,
    )
    return result(launch)


def swiglu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's product (``models.llama.FeedForward``), eager."""
    return F.silu(gate) * up


def swiglu_quantize_fold_reference(gate: torch.Tensor, up: torch.Tensor, **options) -> Epilogue:
    """The composition the fused kernel replaces: the eager product, then ``quantize_fold_fp8``."""
    write = options.pop("write_product", False)
    options.pop("silu", None)
    product = swiglu_product(gate, up)
    out = quantize_fold_fp8(product, **options)
    folded, score = out if options.get("scores") else (out, None)
    return Epilogue(folded, score, product if write else None)
