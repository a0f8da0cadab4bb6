"""The grid Hadamard: round each Hadamard block to a fixed-point grid, then today's transform. On the
grid every sum is exact, so any summation order (the butterfly's, a BLAS's, a tensor core's) gives
the same bits.

``grid_round``: each block ``v`` of ``block_size`` consecutive values along ``axis``, times the
random signs, is rounded to multiples of ``g = 2**(e - 15)``, ``e = max(floor(log2(max|v|)), -100)``,
ties to even: ``q = n * g`` with integers ``|n| <= 2**16``; values below ``g / 2`` vanish, to +0
(with no -0 among the addends no order of the sums makes a -0, whose sign an MXFP4 code keeps).
``q`` is exact in the input dtype (bfloat16 keeps 8 significant bits of values of at least
``2**(e - 8)``, below which ``|n| <= 2**7``; float16 likewise with 11). A block holding a NaN or
Inf, or whose maximum is at least ``2**119``, becomes NaN.

``grid_hadamard_transform(x, signs) = hadamard_transform(grid_round(x, signs))`` (no signs left to
apply): the butterfly's partial sums are multiples of ``g`` below ``2**21 * g`` (``2**24 * g`` for
256-point blocks) and ``2**128``, exact in float32 in any order; only the final multiply by
``1/sqrt(n)`` and the rounding to the input dtype round, as today. The floor of -100 keeps ``g`` a
normal float32 (no subnormal operand or sum anywhere); ``2**119`` keeps every partial sum of a
256-point block finite and the rounding constant ``1.5 * 2**(e + 8)`` a float32.
"""

from __future__ import annotations

import math

import torch

from adahop.transforms.hadamard import check_hadamard_args, hadamard_matrix, hadamard_transform

GRID_BITS = 15  # the block maximum sits in [2**15, 2**16) grid units
MIN_EXPONENT = -100  # e's floor: g = 2**(e - 15) >= 2**-115 stays normal
MAX_EXPONENT = 118  # blocks with max|v| >= 2**119 become NaN: partial sums stay below 2**128
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grid_exponent(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each float32 block's ``e`` (int32, [..., 1]) and whether the block stays a number, read from its
    maximum's float32 exponent field (subnormal maxima read -127, then the floor)."""
    amax = v.abs().amax(dim=-1, keepdim=True)  # NaN if the block holds one
    e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=MIN_EXPONENT)
    return e, amax.isfinite() & (e <= MAX_EXPONENT)


def grid_round(
    x: torch.Tensor, *, axis: int = -1, block_size: int = 32, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` times the signs, each Hadamard block rounded to its grid (ties to even), in ``x``'s dtype
    (exact). The signs come first: a sign flips a zero to -0, which the rounding makes +0."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"the grid Hadamard takes {INPUT_DTYPES}, got {x.dtype}")
    axis = axis % x.dim()
    check_hadamard_args(x.shape[axis], block_size, signs)
    v = x.movedim(axis, -1).to(torch.float32).unflatten(-1, (-1, block_size))
    if signs is not None:
        v = v * signs.to(device=x.device, dtype=torch.float32)
    # Adding 1.5 * 2**(e + 8), whose float32 spacing is g, rounds v to the grid once, ties to even;
    # subtracting it back is exact and leaves +0 where v vanishes.
    e, ok = grid_exponent(v)
    magic = (((e + (23 - GRID_BITS + 127)) << 23) | 0x400000).view(torch.float32)  # from bits: exact anywhere
    magic = torch.where(ok, magic, float("nan"))
    q = (v + magic) - magic
    return q.flatten(-2).movedim(-1, axis).to(x.dtype)


def grid_hadamard_transform(
    x: torch.Tensor, *, axis: int = -1, block_size: int = 32, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """The spec: today's fixed-order transform (no signs left to apply) of the signed, grid-rounded input."""
    q = grid_round(x, axis=axis, block_size=block_size, signs=signs)
    return hadamard_transform(q, axis=axis, block_size=block_size)


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
    ok = amax.isfinite() & (amax < 2.0 ** (MAX_EXPONENT + 1))
    e = (torch.frexp(torch.where(ok, amax, 1.0)).exponent - 1).clamp(min=MIN_EXPONENT).to(torch.int64)
    grid = ((e - GRID_BITS + 1023) << 52).view(torch.float64)  # 2**(e - 15) from bits: exact on any device
    q = torch.round(v / grid) * grid + 0.0  # the grid values, exact in float64, -0 made +0
    c = float(torch.tensor(1 / math.sqrt(block_size), dtype=torch.float32))  # today's float32 factor
    y = (q @ hadamard_matrix(block_size, dtype=torch.float64, device=x.device)) * c  # exact: 21 + 24 bits
    y = torch.where(ok, y, float("nan")).to(torch.float32)
    return y.flatten(-2).movedim(-1, axis).to(x.dtype)
