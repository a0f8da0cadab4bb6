"""Row-wise scaled FP8 (``"fp8_e4m3_rowwise"``): E4M3 elements times one float32 scale per row.

This pure-PyTorch code is the specification; the Triton kernel (``kernels.quantize_rowwise``) is
tested bit for bit against it. It is the operand of Hopper's row-wise scaled FP8 GEMM
(``torch._scaled_mm``): per token for X, per output channel for W, the rows of ``C = L @ R.T``.
Per row of a 2-D tensor:

1. ``amax`` = max |v| of the row. A row holding NaN or Inf becomes NaN as a whole (every element
   code 0x7F, scale NaN), as an MX block does; an all-zero row gets scale 1.
2. scale ``2**s`` with ``s`` the smallest integer such that ``amax <= 448 * 2**s``
   (``ceil(log2(amax / 448))``, computed exactly from the float32 bits), clamped to [-126, 126].
   A power of two, not torchao's exact ``amax / 448``: dividing by it is exact, so the only
   rounding is the element rounding below, dequantization is exact, and a row's relative
   precision is E4M3's 3 mantissa bits either way; the price is at most one binade of the
   E4M3 range left unused at the top (the row max lands in (224, 448]).
3. each element ``v / 2**s`` rounded to nearest (ties to even) onto the E4M3 grid (subnormals
   included, saturating at 448, which the scale already guarantees), exactly as
   ``ml_dtypes.float8_e4m3fn`` rounds.

K is zero-padded to a multiple of ``ROWWISE_K_ALIGN`` (cuBLAS FP8 needs it; zeros add nothing to
``L @ R.T``). Row-wise FP8 needs no MX blocks, so it is a format of its own, not an MX format:
the forward GEMM takes it through ``Recipe.forward_fmt``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .elements import E4M3, round_to_element

ROWWISE_FP8 = "fp8_e4m3_rowwise"
ROWWISE_K_ALIGN = 16
MIN_SCALE_EXP, MAX_SCALE_EXP = -126, 126  # 2**s stays a normal float32 (and so does 2**-s)
E4M3_NAN_CODE = 0x7F


@dataclass
class RowwiseFP8:
    """A 2-D matrix as E4M3 values times a float32 scale per row (the row-wise ``_scaled_mm`` operand)."""

    data: torch.Tensor  # float8_e4m3fn [rows, padded_k]
    row_scale: torch.Tensor  # float32 [rows]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """float32 values [rows, padded_k] (exact: each is an E4M3 value times a power of two)."""
        return self.data.to(torch.float32) * self.row_scale[:, None]


def rowwise_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``s``: the smallest with ``amax <= 448 * 2**s``, clamped to [-126, 126]; 0 for a zero amax.

    ``amax = m * 2**e`` with ``m`` in [0.5, 1) and ``448 = 0.875 * 2**9``, so ``s = e - 9`` when
    ``m <= 0.875`` and ``e - 8`` otherwise: no rounded logarithm or division.
    """
    m, e = torch.frexp(amax.to(torch.float32))
    s = e - 9 + (m > 0.875).to(torch.int32)
    return torch.where(amax == 0, 0, s.clamp(MIN_SCALE_EXP, MAX_SCALE_EXP)).to(torch.int32)


def quantize_fp8_rowwise(x: torch.Tensor) -> RowwiseFP8:
    """E4M3 with a power-of-two scale per row of a 2-D float tensor (the spec above)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"quantize_fp8_rowwise takes a 2-D float32, bfloat16 or float16 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    v = x.to(torch.float32)
    pad = -v.shape[1] % ROWWISE_K_ALIGN
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    amax = v.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    s = rowwise_scale_exponent(torch.where(finite, amax, 0.0))
    q = round_to_element(torch.ldexp(v, -s[:, None]), E4M3)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8)  # exact: q is on the E4M3 grid
    codes = torch.where(finite[:, None], codes, E4M3_NAN_CODE)
    scale = torch.where(finite, torch.ldexp(torch.ones_like(amax), s), float("nan"))
    return RowwiseFP8(codes.view(torch.float8_e4m3fn), scale)
