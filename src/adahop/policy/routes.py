"""Which route computes an MX GEMM: one function, ``gemm_route``, that every caller asks.

``adahop.ops`` runs what it names (the reference, or a kernel route of ``adahop.kernels.gemm``),
decides from it whether to quantize operands straight into folded FP8, and the step and GEMM
benchmarks report it. A route that cannot serve a case is never swapped for another behind the
caller's back: the other one is what this function returns, so tests pin every case
(``tests/test_routes.py``). No Triton here: the choice is made before any kernel is imported.
Compare routes with ``==``: under ``torch.compile`` the result is a constant of the graph, equal
to the member but not the same object.

Speeds on an H200 relative to cuBLAS BF16 (Llama-3-8B shapes, ``benchmarks/gemm/2026-12-03-h200.md``):
fold_fp8 1.83x, dequant_bf16 0.39x, dot_scaled 0.16x, triton_fp8 0.09x; the last two are only
run when asked for by name.
"""

from __future__ import annotations

import enum
import functools

import torch

from ..formats.rowwise import ROWWISE_FP8

HOPPER = (9, 0)
SCALED_MM_ALIGN = 16  # cuBLAS FP8 needs N (and K) divisible by 16
KERNEL_FORMAT = ("mxfp4", 32)  # the (format, block size) the kernel routes take


class GemmRoute(enum.StrEnum):
    """How ``A @ B.T`` of two MX operands is computed."""

    # cuBLAS row-wise scaled FP8 of E4M3 + row scales: MXFP4 with its block scales folded in, or
    # fp8_e4m3_rowwise operands as they are quantized
    FOLD_FP8 = "fold_fp8"
    TRITON_FP8 = "triton_fp8"  # Triton FP8 GEMM promoting every 32-wide block (no underflow)
    DOT_SCALED = "dot_scaled"  # tl.dot_scaled e2m1 x e2m1 (upcast to BF16 on Hopper)
    DEQUANT_BF16 = "dequant_bf16"  # dequantize to BF16 (exact) and torch.matmul
    REFERENCE = "reference"  # the float32 reference of adahop.ops (every device, every format)


KERNEL_ROUTES = tuple(r for r in GemmRoute if r is not GemmRoute.REFERENCE)


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability, asked once per device (it costs microseconds, and every GEMM asks)."""
    return torch.cuda.get_device_capability(device)


def gemm_route(
    device: torch.device, n: int, fmt: str = "mxfp4", block_size: int = 32, *, kernels: bool = True
) -> GemmRoute:
    """The route for an MX GEMM with ``n`` output columns on ``device``: the fastest faithful one measured.

    ``kernels=False`` (``ops.reference_only``) and anything but CUDA take the reference; so do
    formats the kernels do not implement. On CUDA, Hopper takes fold_fp8 unless cuBLAS FP8 refuses
    ``n`` (not a multiple of 16), where the BF16 emulation measured fastest of the rest; other GPUs
    take dequant_bf16. Row-wise FP8 (``fmt="fp8_e4m3_rowwise"``, no blocks) takes fold_fp8's
    cuBLAS GEMM where MXFP4 would, else the reference.
    """
    # Only n's divisibility matters. Branching on it here turns a symbolic n (a graph compiled with
    # dynamic shapes) into a guard, where the constant function below could not take it.
    if n % SCALED_MM_ALIGN == 0:
        return _route(device, True, fmt, block_size, kernels)
    return _route(device, False, fmt, block_size, kernels)


@torch.compiler.assume_constant_result  # a property of the device and the format: evaluated once per graph
def _route(device: torch.device, aligned: bool, fmt: str, block_size: int, kernels: bool) -> GemmRoute:
    if device.type == "cuda" and kernels and fmt == ROWWISE_FP8:
        return GemmRoute.FOLD_FP8 if device_capability(device) == HOPPER and aligned else GemmRoute.REFERENCE
    if device.type != "cuda" or not kernels or (fmt, block_size) != KERNEL_FORMAT:
        return GemmRoute.REFERENCE
    if device_capability(device) != HOPPER or not aligned:
        return GemmRoute.DEQUANT_BF16
    return GemmRoute.FOLD_FP8
