"""``C = L @ R.T`` for two prepared operands: MX main path plus high-precision outlier paths.

The reference computes the MX product by dequantizing to float32 (exact) and multiplying in
float32; fast kernels replace that one product and nothing else.
"""

from __future__ import annotations

import torch

from ..formats import MXTensor
from .operand import GemmOperand


def _main_values(q: MXTensor | torch.Tensor) -> torch.Tensor:
    return q.dequantize(torch.float32) if isinstance(q, MXTensor) else q.float()


def mx_product(lq: MXTensor | torch.Tensor, rq: MXTensor | torch.Tensor) -> torch.Tensor:
    """float32 ``L @ R.T`` of two quantized (or transform-only) main parts, blocks along K."""
    return _main_values(lq) @ _main_values(rq).T


def tn_matmul(l: GemmOperand, r: GemmOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """Combine the paths of a strategy into ``C = L @ R.T`` ([M, N], ``out_dtype``)."""
    if l.quantized is None or r.quantized is None:  # the BF16 strategy
        return (l.dense @ r.dense.T).to(out_dtype)
    out = mx_product(l.quantized, r.quantized)
    if l.rows is not None:  # OE-left: outlier rows of C from the high-precision path
        out[l.rows] = (l.extracted @ r.dense.T).float()
    if r.rows is not None:  # OE-right: outlier columns of C
        out[:, r.rows] = (l.dense @ r.extracted.T).float()
    return out.to(out_dtype)
