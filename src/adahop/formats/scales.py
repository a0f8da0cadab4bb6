"""E8M0 shared-scale rules: how a block's amax becomes its power-of-two scale.

Every rule returns the unbiased shared exponent ``s`` (scale = 2**s) computed exactly from
float32 exponent bits, clamped to E8M0's range [-127, 127]:

- ``floor`` (OCP MX v1.0 §6.3, the default): ``s = floor(log2 amax) - emax_elem``. The scaled
  block max lands in [2**emax, 2**(emax+1)); for FP4 values in (6, 8) clip to 6 (up to 25%).
- ``ceil``: ``s = ceil(log2 amax) - emax_elem``. Never clips, but for FP4 the block max lands in
  (2, 4] and the top code 6 is never used.
- ``even``: round amax's mantissa to the element's mantissa width (half away from zero) first,
  then ``floor``. Clips only values within half an element ulp of the next binade.
- ``rceil`` (cuBLAS / TransformerEngine): ``s = ceil(log2(fp32(amax / max_normal)))``.
  Never clips (up to the float32 rounding of the division) and uses the whole element range.

The rules agree with torchao's ``ScaleCalculationMode`` of the same names.
"""

from __future__ import annotations

import torch

from .elements import ElementFormat

SCALE_RULES = ("floor", "ceil", "even", "rceil")

E8M0_BIAS = 127
E8M0_NAN = 255
_F32_MBITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MBITS) - 1


def _exponent_bits(x: torch.Tensor) -> torch.Tensor:
    """Unbiased float32 exponent field of ``x >= 0`` (int32); subnormals read as -127."""
    bits = x.to(torch.float32).view(torch.int32)
    return ((bits >> _F32_MBITS) & 0xFF) - E8M0_BIAS


def _has_mantissa(x: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32).view(torch.int32) & _F32_MANTISSA_MASK) != 0


def shared_exponent(amax: torch.Tensor, fmt: ElementFormat, rule: str) -> torch.Tensor:
    """Unbiased shared exponent (int32) of finite, non-negative block maxima ``amax``."""
    amax = amax.to(torch.float32)
    if rule == "floor":
        s = _exponent_bits(amax) - fmt.emax
    elif rule == "ceil":
        s = _exponent_bits(amax) + _has_mantissa(amax).to(torch.int32) - fmt.emax
    elif rule == "even":
        half_ulp = 1 << (_F32_MBITS - fmt.mbits - 1)
        rounded = ((amax.view(torch.int32) + half_ulp) & ~_F32_MANTISSA_MASK).view(torch.float32)
        s = _exponent_bits(rounded) - fmt.emax
    elif rule == "rceil":
        descale = amax / fmt.max_normal
        e = _exponent_bits(descale)
        mantissa = descale.view(torch.int32) & _F32_MANTISSA_MASK
        # A subnormal descale is mantissa * 2**-149: above 2**-127 only when mantissa > 2**22.
        up = torch.where(e == -E8M0_BIAS, mantissa > (1 << (_F32_MBITS - 1)), mantissa != 0)
        s = e + up.to(torch.int32)
    else:
        raise ValueError(f"unknown scale_rule {rule!r}; choose one of {SCALE_RULES}")
    return torch.clamp(s, -E8M0_BIAS, E8M0_BIAS)


def scale_codes(amax: torch.Tensor, fmt: ElementFormat, rule: str) -> torch.Tensor:
    """E8M0 codes (uint8) for block maxima; 255 (NaN) where amax is NaN or Inf."""
    finite = torch.isfinite(amax)
    s = shared_exponent(torch.where(finite, amax, 0.0), fmt, rule)
    return torch.where(finite, s + E8M0_BIAS, E8M0_NAN).to(torch.uint8)


def scale_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value 2**(code - 127) of E8M0 codes; NaN for code 255. Exact (2**-127 is subnormal)."""
    s = codes.to(torch.int32) - E8M0_BIAS
    vals = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s)
    return torch.where(codes == E8M0_NAN, torch.full_like(vals, float("nan")), vals)
