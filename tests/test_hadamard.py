"""Block Hadamard transform: orthonormal, involutive, GEMM-invariant, block-local."""

import math

import pytest
import torch

from adahop import hadamard_transform
from adahop.transforms import hadamard_matrix, hadamard_rotation, random_signs


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256])
def test_sylvester_matrix_is_orthogonal(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert set(h.unique().tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("n", [16, 32, 256])
@pytest.mark.parametrize("signed", [False, True])
def test_orthonormal_norm_preserving(n, signed):
    signs = random_signs(n, seed=3) if signed else None
    q = hadamard_rotation(n, signs, dtype=torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = torch.randn(7, 4 * n, dtype=torch.float64)
    y = hadamard_transform(x, block_size=n, signs=signs)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-12)


def test_involutive_without_signs():
    x = torch.randn(5, 128, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-12)


@pytest.mark.parametrize("signed", [False, True])
def test_gemm_invariance(signed):
    signs = random_signs(32, seed=1) if signed else None
    a = torch.randn(8, 96, dtype=torch.float64)
    b = torch.randn(12, 96, dtype=torch.float64)
    ah = hadamard_transform(a, signs=signs)
    bh = hadamard_transform(b, signs=signs)
    assert torch.allclose(ah @ bh.T, a @ b.T, atol=1e-10)


def test_block_local_and_axis():
    x = torch.zeros(64, 3, dtype=torch.float64)
    x[40, 1] = 1.0  # a spike in block 1 along axis 0
    y = hadamard_transform(x, axis=0)
    assert torch.all(y[:32] == 0) and torch.all(y[:, [0, 2]] == 0)
    assert torch.allclose(y[32:, 1].abs(), torch.full((32,), 1 / math.sqrt(32), dtype=torch.float64))


def test_spreads_an_outlier_over_its_block():
    x = torch.randn(1, 32) * 0.01
    x[0, 3] = 100.0
    y = hadamard_transform(x)
    assert y.abs().max() < 100.0 / math.sqrt(32) * 1.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_keeps_dtype(dtype):
    assert hadamard_transform(torch.randn(2, 64, dtype=dtype)).dtype == dtype


def test_bad_arguments():
    with pytest.raises(ValueError, match="one of"):
        hadamard_transform(torch.randn(4, 96), block_size=48)
    with pytest.raises(ValueError, match="multiple"):
        hadamard_transform(torch.randn(4, 48))
    with pytest.raises(ValueError, match="shape"):
        hadamard_transform(torch.randn(4, 64), signs=torch.ones(16))


def test_integer_tensors_and_bad_axes_are_rejected():
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        hadamard_transform(torch.arange(64).reshape(2, 32))
    with pytest.raises(IndexError, match="axis 2 is out of range"):
        hadamard_transform(torch.randn(2, 32), axis=2)


def sylvester_by_popcount(n: int) -> torch.Tensor:
    """H[i, j] = (-1)**popcount(i & j): the Sylvester Hadamard matrix, defined independently."""
    i = torch.arange(n)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for k in range(n.bit_length()):
        parity ^= (bits >> k) & 1
    return (1 - 2 * parity).double()


@pytest.mark.parametrize("n", [16, 32, 128])
@pytest.mark.parametrize("axis", [-1, 0])
def test_signed_transform_is_the_documented_matrix(n, axis):
    """``hadamard_transform(x, signs)`` is ``b @ diag(signs) @ H / sqrt(n)`` per block (the signs
    act *before* H), with H from the popcount definition, and ``hadamard_rotation`` is that Q."""
    signs = random_signs(n, seed=7)
    q = torch.diag(signs.double()) @ sylvester_by_popcount(n) / math.sqrt(n)
    assert torch.equal(hadamard_matrix(n, dtype=torch.float64), sylvester_by_popcount(n))
    assert torch.allclose(hadamard_rotation(n, signs, dtype=torch.float64), q, rtol=0, atol=1e-15)
    x = torch.randn(2 * n, n, dtype=torch.float64)
    want = (x.movedim(axis, -1).unflatten(-1, (-1, n)) @ q).flatten(-2).movedim(-1, axis)
    got = hadamard_transform(x, axis=axis, block_size=n, signs=signs)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
