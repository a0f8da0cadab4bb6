"""Triton kernels for CUDA (and the Triton interpreter on CPU), each tested bit-for-bit or within a
stated tolerance against the reference in ``adahop.formats``. Importing this package imports Triton;
``adahop.ops`` does so only when a kernel actually runs.

- ``quantize``: fused (Hadamard +) MX quantization, either or both orientations from one read
- ``fold``: MXFP4 codes + E8M0 scales -> E4M3 values + a per-row scale (exact within 14 binades)
- ``gemm``: ``route_matmul``: the GEMM routes for Hopper (``fold_fp8`` through cuBLAS, Triton FP8, dot_scaled); which
  route a GEMM takes is ``adahop.policy.routes.gemm_route``'s choice
"""

from .fold import FoldedFP8, fold_to_fp8
from .gemm import route_matmul
from .quantize import quantize_mx_triton, quantize_mx_triton_both
from .quantize_tiling import QuantizeTiling

__all__ = [
    "FoldedFP8",
    "QuantizeTiling",
    "fold_to_fp8",
    "route_matmul",
    "quantize_mx_triton",
    "quantize_mx_triton_both",
]
