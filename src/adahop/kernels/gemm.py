"""``route_matmul``: ``C = A @ B.T`` for two MXFP4 operands blocked along K, by the route it is given.

Every GEMM of a linear layer can be written in this TN form by quantizing the right copy of each
operand (see :mod:`adahop.gemm.operand`). The routes (``policy.routes.GemmRoute``; which one a
GEMM takes is ``policy.routes.gemm_route``'s choice, never this module's), with their speed on an
H200 relative to cuBLAS BF16 (geometric mean over the Llama-3-8B shapes,
``benchmarks/gemm/2026-12-03-h200.md``):

- ``"fold_fp8"`` (1.83x, fold included; 2.08x without): fold block scales into E4M3 values and
  per-row scales (:mod:`adahop.kernels.fold`), then cuBLAS's row-wise scaled FP8 GEMM
  (``torch._scaled_mm``). Exact unless a block lies more than 14 binades below its row's largest;
  such underflowed elements are counted (``return_stats=True``).
- ``"triton_fp8"`` (0.09x): a Triton FP8 GEMM that decodes nibbles in registers and promotes
  every 32-wide block (:mod:`adahop.kernels.gemm_triton`). No underflow.
- ``"dot_scaled"`` (0.16x): ``tl.dot_scaled`` e2m1 x e2m1, upcast to BF16 on Hopper.
- ``"dequant_bf16"`` (0.39x): dequantize to BF16 (exact) and ``torch.matmul``; runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MXTensor
from ..formats.rowwise import RowwiseFP8
from ..policy.routes import KERNEL_ROUTES, GemmRoute
from .fold import check_fold_operand, fold_to_fp8
from .gemm_triton import OUT_DTYPES, mxfp4_dot_scaled_matmul, mxfp4_fp8_matmul


@dataclass(frozen=True)
class MatmulStats:
    """Precision the route lost: elements of each operand that underflowed (fold_fp8 only)."""

    route: GemmRoute
    lossy_a: int = 0
    lossy_b: int = 0


def check_operands(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> None:
    """Raise a clear error unless ``a`` [M, K] and ``b`` [N, K] are MXFP4 blocked along K."""
    for name, x in (("a", a), ("b", b)):
        try:
            check_fold_operand(x)
        except (TypeError, ValueError) as err:
            raise type(err)(f"route_matmul operand {name}: {err}") from None
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"route_matmul computes a @ b.T: K differs, a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.block_size != b.block_size:
        raise ValueError(f"operands have different block sizes: {a.block_size} and {b.block_size}")
    if a.device != b.device:
        raise ValueError(f"operands are on different devices: {a.device} and {b.device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"unsupported out_dtype {out_dtype}; choose one of {tuple(OUT_DTYPES)}")


def fold_fp8_matmul(
    a: RowwiseFP8, b: RowwiseFP8, out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = True
) -> torch.Tensor:
    """Row-wise scaled FP8 GEMM of two row-scaled E4M3 operands (folded MXFP4 or
    ``fp8_e4m3_rowwise``): ``(a.data @ b.data.T) * sa[:, None] * sb``."""
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.row_scale[:, None],
        scale_b=b.row_scale[None, :],
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def route_matmul(
    a: MXTensor,
    b: MXTensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    route: GemmRoute | str,
    fast_accum: bool = True,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, MatmulStats]:
    """``A @ B.T`` ([M, N], ``out_dtype``) for MXFP4 ``a`` [M, K] and ``b`` [N, K], blocks along K,
    by the kernel ``route`` named (``policy.routes.gemm_route`` says which one a GEMM should take).

    ``fast_accum`` (``fold_fp8`` only) lets cuBLAS accumulate in the FP8 tensor core's reduced
    precision instead of promoting to FP32 periodically: faster, and faithful on the Llama shapes
    (``adahop bench --only gemm``); pass False where operands span many binades (TransformerEngine's
    convention: fast for forward, split accumulation for the gradient GEMMs).
    ``return_stats=True`` also returns a :class:`MatmulStats` counting the elements the route
    could not represent exactly (this synchronizes with the GPU).
    """
    if route not in KERNEL_ROUTES:
        raise ValueError(f"unknown kernel route {route!r}; choose one of {[str(r) for r in KERNEL_ROUTES]}")
    route = GemmRoute(route)
    check_operands(a, b, out_dtype)

    stats = MatmulStats(route)
    if route == GemmRoute.FOLD_FP8:
        fa, fb = fold_to_fp8(a), fold_to_fp8(b)
        out = fold_fp8_matmul(fa, fb, out_dtype, fast_accum)
        if return_stats:
            stats = MatmulStats(route, fa.n_lossy, fb.n_lossy)
    elif route == GemmRoute.TRITON_FP8:
        out = mxfp4_fp8_matmul(a, b, out_dtype)
    elif route == GemmRoute.DOT_SCALED:
        out = mxfp4_dot_scaled_matmul(a, b, out_dtype)
    else:
        out = (a.dequantize(torch.bfloat16) @ b.dequantize(torch.bfloat16).T).to(out_dtype)
    return (out, stats) if return_stats else out
