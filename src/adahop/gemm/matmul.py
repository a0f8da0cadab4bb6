"""``C = L @ R.T`` for two prepared operands: MX main path plus high-precision outlier paths.

The MX product goes through ``adahop.ops``, which runs the route ``policy.routes.gemm_route``
names (the reference on any device, the fastest faithful kernel route on CUDA); this module only
matches the operands' forms (folded FP8 exists only where that route is fold_fp8). The outlier
rows and columns are small high-precision GEMMs written straight into the output.
"""

from __future__ import annotations

import torch

from .. import ops
from ..formats import MXTensor
from ..formats.rowwise import RowwiseFP8
from .operand import GemmOperand


def _main_product(
    lq: MXTensor | RowwiseFP8 | torch.Tensor,
    rq: MXTensor | RowwiseFP8 | torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
    reference: bool,
) -> torch.Tensor:
    if reference and not isinstance(lq, torch.Tensor):
        return ops.reference_matmul(lq, rq, out_dtype)
    if isinstance(lq, RowwiseFP8) or isinstance(rq, RowwiseFP8):  # folded MXFP4 or fp8_e4m3_rowwise
        return ops.folded_matmul(lq, rq, out_dtype, fast_accum=fast_accum)
    if isinstance(lq, MXTensor):
        return ops.mx_matmul(lq, rq, out_dtype, fast_accum=fast_accum)
    return ops.output_as(lq.float() @ rq.float().T, out_dtype)  # transform-only ablation (fmt=None)


def tn_matmul(
    l: GemmOperand, r: GemmOperand, out_dtype: torch.dtype, *, fast_accum: bool = True, reference: bool = False
) -> torch.Tensor:
    """Combine the paths of a strategy into ``C = L @ R.T`` ([M, N], ``out_dtype``). ``fast_accum``:
    cuBLAS's reduced-precision accumulation in the FP8 GEMM of the fold_fp8 route (``ops``);
    ``reference``: the quantized product through ``ops.reference_matmul`` on any device."""
    if l.quantized is None or r.quantized is None:  # the BF16 strategy
        return (l.dense @ r.dense.T).to(out_dtype)
    out = _main_product(l.quantized, r.quantized, out_dtype, fast_accum, reference)
    if l.rows is not None:  # OE-left: outlier rows of C from the high-precision path
        out[l.rows] = (l.extracted @ r.dense.T).to(out_dtype)
    if r.rows is not None:  # OE-right: outlier columns of C
        out[:, r.rows] = (l.dense @ r.extracted.T).to(out_dtype)
    return out
