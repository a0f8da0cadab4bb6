"""The grid Hadamard: a block Hadamard transform whose every sum is exact, so any summation order
(the butterfly's, a BLAS's, a tensor core's) gives the same bits.

Each block ``v`` (``block_size`` values after the random signs, float32) is first rounded to the
fixed-point grid ``g = 2**(e - 15)``, ``e = max(floor(log2(max|v|)), -100)``: ``n = round(v / g)``
(ties to even), integers with ``|n| <= 2**16``. A 32-point Hadamard's partial sums of ``n`` are
integers below ``2**21`` (a 256-point one's at most ``2**24``): exact in float32 in any order. The
output is ``fl32(S * c * g)`` for ``S = n @ H`` and ``c = fl32(1 / sqrt(block_size))``, one rounding
of an exact product (``c * g`` is an exact float32: ``e - 15 >= -115``), then rounded to the input
dtype as ``hadamard_transform`` does. A block holding a NaN or Inf becomes NaN.

``e`` is read from the float32 exponent field: the clamp at -100 covers subnormal maxima (and
keeps ``c * g`` normal), and ``2**(15 - e)`` stays a normal float32 for every finite maximum.
"""

from __future__ import annotations

import math

import torch

from adahop.transforms.hadamard import check_hadamard_args, hadamard_matrix, walsh_hadamard_butterfly

GRID_BITS = 15  # the block maximum sits in [2**15, 2**16) grid units
MIN_EXPONENT = -100  # e's floor: subnormal maxima, and c * 2**(e - 15) stays a normal float32
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _blocks(x: torch.Tensor, axis: int, block_size: int, signs: torch.Tensor | None) -> torch.Tensor:
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"the grid Hadamard takes {INPUT_DTYPES}, got {x.dtype}")
    check_hadamard_args(x.shape[axis], block_size, signs)
    v = x.movedim(axis, -1).to(torch.float32).unflatten(-1, (-1, block_size))
    return v if signs is None else v * signs.to(device=x.device, dtype=torch.float32)


def grid_exponent(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's ``e`` (int32, [..., 1]) and whether it is finite, from its float32 maximum."""
    amax = v.abs().amax(dim=-1, keepdim=True)  # NaN if the block holds one
    finite = amax.isfinite()
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    return torch.where(finite, e.clamp(min=MIN_EXPONENT), 0), finite


def exp2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def grid_units(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``round(v / 2**(e - 15))``, ties to even, as float32 integers (the product is exact or below
    2**-126, where it rounds to 0 either way)."""
    return torch.round(v * exp2(GRID_BITS - e))


def grid_hadamard_transform(
    x: torch.Tensor, *, axis: int = -1, block_size: int = 32, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: grid rounding, the butterfly on the integers (exact), one rounding of
    ``S * c * g`` in float32, then the input dtype."""
    axis = axis % x.dim()
    v = _blocks(x, axis, block_size, signs)
    e, finite = grid_exponent(v)
    s = walsh_hadamard_butterfly(grid_units(v, e))
    scale = exp2(e - GRID_BITS) * torch.tensor(1 / math.sqrt(block_size), dtype=torch.float32)  # exact
    y = torch.where(finite, s * scale, float("nan"))
    return y.flatten(-2).movedim(-1, axis).to(x.dtype)


def grid_hadamard_oracle(
    x: torch.Tensor, *, axis: int = -1, block_size: int = 32, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """The same spec computed independently: float64 throughout, ``e`` from ``frexp``, the
    transform as a float64 matmul (BLAS order), one float64 -> float32 rounding at the end."""
    axis = axis % x.dim()
    v = x.movedim(axis, -1).to(torch.float64).unflatten(-1, (-1, block_size))
    if signs is not None:
        v = v * signs.to(device=x.device, dtype=torch.float64)
    amax = v.abs().amax(dim=-1, keepdim=True)
    finite = amax.isfinite()
    e = (torch.frexp(torch.where(finite, amax, 1.0)).exponent - 1).clamp(min=MIN_EXPONENT).to(torch.float64)
    grid = torch.exp2(e - GRID_BITS)
    q = torch.round(v / grid) * grid  # the grid values, exact in float64
    c = float(torch.tensor(1 / math.sqrt(block_size), dtype=torch.float32))
    y = (q @ hadamard_matrix(block_size, dtype=torch.float64, device=x.device)) * c  # exact
    y = torch.where(finite, y, float("nan")).to(torch.float32)
    return y.flatten(-2).movedim(-1, axis).to(x.dtype)


def butterfly_on_grid_values(
    x: torch.Tensor, *, axis: int = -1, block_size: int = 32, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """Today's transform (float32 butterfly, then ``* c``) applied to the grid values ``n * g``:
    the same bits as the spec wherever no float32 partial sum overflows (block maxima below 2**122)."""
    axis = axis % x.dim()
    v = _blocks(x, axis, block_size, signs)
    e, finite = grid_exponent(v)
    q = grid_units(v, e) * exp2(e - GRID_BITS)  # exact: e - 15 >= -115
    y = walsh_hadamard_butterfly(q) * torch.tensor(1 / math.sqrt(block_size), dtype=torch.float32)
    y = torch.where(finite, y, float("nan"))
    return y.flatten(-2).movedim(-1, axis).to(x.dtype)
