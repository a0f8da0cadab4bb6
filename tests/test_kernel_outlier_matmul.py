"""The OE high-precision path (``adahop::outlier_matmul``) against float64 math.

Without CUDA the Triton kernel runs under TRITON_INTERPRET=1 (conftest.py sets it); with CUDA the
same tests run the compiled kernel. The kernel accumulates 16-bit products (exact in float32) in
float32 and rounds once, so it is checked against the float64 product rounded to the output dtype.
"""

import pytest
import torch

from adahop import ops
from adahop.kernels.outlier_matmul import outlier_matmul_triton, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def scattered_index(size: int, count: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(size, generator=g)[:count].to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_kernel_writes_the_rounded_product_and_nothing_else(dtype, out_dtype, dim, transposed):
    # k = 5 extracted rows and K = 100: neither is a multiple of a tile side.
    dense_rows, k_rows, k = 70, 5, 100
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(dense_rows, k, generator=g)
    if transposed:  # same values, column-major storage
        dense = dense.t().contiguous().t()
    dense = dense.to(DEVICE, dtype)
    extracted = torch.randn(k_rows, k, generator=g).to(DEVICE, dtype)
    a, b = (extracted, dense) if dim == 0 else (dense, extracted)
    out_shape = (3 * k_rows, dense_rows) if dim == 0 else (dense_rows, 3 * k_rows)
    out = torch.full(out_shape, 7.0, dtype=out_dtype, device=DEVICE)
    index = scattered_index(out_shape[dim], k_rows)

    assert supports(a, b)
    outlier_matmul_triton(out, a, b, index, dim)

    exact = (a.double() @ b.double().T).to(out_dtype)
    written = out.index_select(dim, index)
    if out_dtype is torch.float32:
        torch.testing.assert_close(written, exact.float(), rtol=1e-5, atol=1e-5)
    else:  # one rounding of an FP32 sum: equal to the rounded exact value up to one BF16 step
        torch.testing.assert_close(written, exact, rtol=2**-7, atol=1e-2)
    untouched = torch.ones(out_shape[dim], dtype=torch.bool, device=DEVICE)
    untouched[index] = False
    assert (out.index_select(dim, untouched.nonzero().flatten()) == 7.0).all()


@pytest.mark.parametrize("dim", [0, 1])
def test_kernel_matches_the_reference_op(dim):
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(40, 96, generator=g).to(DEVICE, torch.bfloat16)
    extracted = torch.randn(8, 96, generator=g).to(DEVICE, torch.bfloat16)
    a, b = (extracted, dense) if dim == 0 else (dense, extracted)
    index = scattered_index(24, 8)
    out_shape = (24, 40) if dim == 0 else (40, 24)
    kernel_out = torch.zeros(out_shape, dtype=torch.float32, device=DEVICE)
    outlier_matmul_triton(kernel_out, a, b, index, dim)
    with ops.reference_only():
        reference_out = torch.zeros_like(kernel_out)
        ops.outlier_matmul_op(reference_out, a, b, index, dim)
    # The reference rounds its product to BF16 before the FP32 output; the kernel rounds once.
    torch.testing.assert_close(kernel_out, reference_out, rtol=2**-8, atol=1e-2)


def test_op_rejects_mismatched_shapes():
    out = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="does not fill 4 rows"):
        ops.outlier_matmul(out, torch.randn(4, 32), torch.randn(9, 32), torch.arange(4), dim=0)
    with pytest.raises(ValueError, match="does not fill 2 columns"):
        ops.outlier_matmul(out, torch.randn(16, 32), torch.randn(2, 31), torch.arange(2), dim=1)


def test_float32_operands_take_the_reference_path():
    out = torch.zeros(6, 10)
    a, b, index = torch.randn(2, 16), torch.randn(10, 16), torch.tensor([1, 4])
    assert not supports(a, b)
    ops.outlier_matmul(out, a, b, index, dim=0)
    torch.testing.assert_close(out[index], a @ b.T)
