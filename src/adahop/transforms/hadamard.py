"""Block-diagonal Hadamard transforms along one axis.

The transform of a block ``b`` (a row vector of ``block_size`` consecutive elements along
``axis``) is ``b @ Q`` with ``Q = diag(signs) @ H / sqrt(block_size)`` and ``H`` the Sylvester
Hadamard matrix. ``Q`` is orthonormal, so transforming both operands of a GEMM along its
contraction dimension leaves the product unchanged: ``(A Q)(B Q)^T = A B^T``. Without signs
``Q`` is symmetric and the transform is its own inverse.

``hadamard_transform`` computes ``b @ Q`` as a fixed-order fast Walsh-Hadamard butterfly
(``log2(n)`` stages of one add or subtract per output, strides 1, 2, 4, ...) followed by a
single multiply by ``1/sqrt(n)``. Unlike a matmul, whose summation order is up to the BLAS,
every float32 rounding here is pinned down, so the fused Triton quantizer
(:mod:`adahop.kernels.quantize`) reproduces the transform bit for bit.
"""

from __future__ import annotations

import math

import torch

HADAMARD_BLOCK_SIZES = (16, 32, 64, 128, 256)


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), entries +-1, unscaled."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def random_signs(block_size: int, seed: int = 0, device=None) -> torch.Tensor:
    """A seeded +-1 vector for the random-sign variant (same on every device)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (block_size,), generator=gen)
    return (1 - 2 * bits).to(dtype=torch.float32, device=device)


def _check_signs(signs: torch.Tensor, block_size: int) -> None:
    if signs.shape != (block_size,):
        raise ValueError(f"signs must have shape ({block_size},), got {tuple(signs.shape)}")


def check_hadamard_args(length: int, block_size: int, signs: torch.Tensor | None = None) -> None:
    """Raise a clear error unless blocks of ``block_size`` (and ``signs``) tile ``length``."""
    if block_size not in HADAMARD_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {HADAMARD_BLOCK_SIZES}, got {block_size}")
    if length % block_size:
        raise ValueError(f"axis length {length} is not a multiple of block_size {block_size}")
    if signs is not None:
        _check_signs(signs, block_size)


def hadamard_rotation(
    block_size: int, signs: torch.Tensor | None = None, *, dtype=torch.float32, device=None
) -> torch.Tensor:
    """The orthonormal ``block_size x block_size`` matrix ``Q = diag(signs) H / sqrt(n)``."""
    q = hadamard_matrix(block_size, dtype=torch.float64, device=device) / math.sqrt(block_size)
    if signs is not None:
        _check_signs(signs, block_size)
        q = signs.to(device=q.device, dtype=q.dtype).unsqueeze(1) * q
    return q.to(dtype)


def walsh_hadamard_butterfly(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized ``v @ H`` along the last axis (a power of two), in ``v``'s dtype.

    Stage ``h`` (1, 2, 4, ...) maps each pair ``(a, b) = (v[i], v[i + h])`` to
    ``(a + b, a - b)``; the kernel runs the same stages in the same order.
    """
    n = v.shape[-1]
    h = 1
    while h < n:
        pairs = v.unflatten(-1, (-1, 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return v


def hadamard_transform(
    x: torch.Tensor,
    *,
    axis: int = -1,
    block_size: int = 32,
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply the block-diagonal Hadamard rotation along ``axis`` (length a multiple of block_size).

    Computed in float32 (float64 for float64 input) by the butterfly above and returned in
    ``x``'s dtype.
    """
    if not x.is_floating_point():
        raise TypeError(f"hadamard_transform expects a floating-point tensor, got {x.dtype}")
    if not -x.dim() <= axis < x.dim():
        raise IndexError(f"hadamard_transform: axis {axis} is out of range for a {x.dim()}-D tensor")
    axis = axis % x.dim()
    check_hadamard_args(x.shape[axis], block_size, signs)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.movedim(axis, -1).to(work).unflatten(-1, (-1, block_size))
    if signs is not None:
        v = v * signs.to(device=x.device, dtype=work)
    v = walsh_hadamard_butterfly(v) * torch.tensor(1 / math.sqrt(block_size), dtype=work)
    return v.flatten(-2).movedim(-1, axis).to(x.dtype)


def walsh_hadamard_rows(v: torch.Tensor, block_size: int) -> torch.Tensor:
    """``walsh_hadamard_butterfly`` over blocks along dim 1 of a contiguous ``[P, K, Q]`` tensor.

    The same stages and the same additions, so the same bits, but K is not moved last: the pair
    ``(v[:, i], v[:, i + h])`` is two contiguous rows of Q values, and each stage is one add and
    one subtract over the whole tensor instead of many short strided ones.
    """
    p, k, q = v.shape
    src, dst = v, torch.empty_like(v)
    h = 1
    while h < block_size:
        (a, b), (total, difference) = (t.view(p, k // (2 * h), 2, h, q).unbind(2) for t in (src, dst))
        torch.add(a, b, out=total)
        torch.sub(a, b, out=difference)
        src, dst = dst, (torch.empty_like(v) if src is v else src)
        h *= 2
    return src
