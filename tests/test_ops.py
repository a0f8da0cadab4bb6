"""Every ``adahop::`` custom op passes ``torch.library.opcheck``: schema, fake (meta) kernel,
autograd registration and aliasing. On the GPU the CUDA kernels are checked too."""

import pytest
import torch

from adahop import ops
from adahop.formats import quantize_mx

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(rows: int = 6, cols: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * cols)
    return (torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen))).to(
        DEVICE
    )


@pytest.mark.parametrize("scores", (False, True))
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("axis", (0, 1))
def test_quantize_mx_op(axis, rounding, scores):
    seed = torch.tensor(3, device=DEVICE)
    args = (_x(32, 64), "mxfp4", axis, 32, "floor", rounding, seed, 32, None, scores)
    torch.library.opcheck(ops.quantize_mx_op, args)


@pytest.mark.parametrize("scores", (False, True))
def test_quantize_fold_op(scores):
    seed = torch.tensor(5, device=DEVICE)
    torch.library.opcheck(ops.quantize_fold_op, (_x(), "floor", "stochastic", seed, 32, None, scores))


def test_fold_op():
    mx = quantize_mx(_x().cpu(), "mxfp4")
    torch.library.opcheck(ops.fold_op, (mx.data.to(DEVICE), mx.scales.to(DEVICE), 32))


def test_mx_matmul_op():
    a, b = quantize_mx(_x(8, 64).cpu(), "mxfp4"), quantize_mx(_x(16, 64).cpu(), "mxfp4")
    args = (a.data, a.scales, b.data, b.scales)
    for fast_accum in (True, False):
        torch.library.opcheck(
            ops.mx_matmul_op, (*(t.to(DEVICE) for t in args), "mxfp4", 32, torch.bfloat16, fast_accum)
        )


def test_top_rows_op():
    torch.library.opcheck(ops.top_rows_op, (_x(1, 300).flatten().abs(), 7))
