"""Quantize straight into the folded FP8 operand, bit for bit against quantize-then-fold.

The spec is ``fold_to_fp8_reference(quantize_mx(hadamard_transform(x)))``: E4M3 bytes, row
scales and lossy counts must all match. Runs in Triton's interpreter without a GPU.
"""

import copy
from unittest import mock

import pytest
import torch

from adahop import ops
from adahop.formats import SCALE_RULES, quantize_mx
from adahop.kernels.fold import fold_to_fp8_reference
from adahop.kernels.quantize_fold import MAX_WARPS, _tile, quantize_fold_fp8
from adahop.nn import AdaHOPLinear
from adahop.policy.strategies import LayerPlan
from adahop.transforms import hadamard_transform, random_signs

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow):RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hard_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows over 40 binades, a NaN and an Inf block, a zero block, and rows whose blocks lie
    more than 14 binades below their largest (so the fold loses bits and counts them)."""
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen))
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3, :32] = 0.0
    x[4, 32:64] *= 2.0**-24  # far below the row's other blocks
    x[5, :] = torch.exp2(torch.linspace(-30, 4, cols))  # a ramp: several far-below blocks
    return x.to(dtype)


def check(x: torch.Tensor, **kwargs) -> None:
    hb, signs = kwargs.get("hadamard_block_size", 0), kwargs.get("signs")
    source = hadamard_transform(x, block_size=hb, signs=signs) if hb else x
    options = {k: v for k, v in kwargs.items() if k in ("scale_rule", "rounding", "seed")}
    want = fold_to_fp8_reference(quantize_mx(source, "mxfp4", **options))
    got = quantize_fold_fp8(x.to(DEVICE), **kwargs)
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8)), "E4M3 bytes differ"
    assert torch.equal(got.row_scale.cpu().view(torch.int32), want.row_scale.view(torch.int32)), "row scales differ"
    assert torch.equal(got.lossy_per_row.cpu(), want.lossy_per_row), "lossy counts differ"


@pytest.mark.parametrize("scale_rule", SCALE_RULES)
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_matches_quantize_then_fold(scale_rule, rounding, hadamard_block_size):
    x = hard_rows(21, 96, torch.float32)  # 96: a row of 3 blocks in a 4-block tile
    check(x, scale_rule=scale_rule, rounding=rounding, seed=7, hadamard_block_size=hadamard_block_size)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_sixteen_bit_inputs_with_signed_hadamard(dtype):
    x = hard_rows(18, 64, dtype)
    check(x, rounding="stochastic", seed=3, hadamard_block_size=32, signs=random_signs(32, seed=1))


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_rows_within_e4m3_normal_range(rounding, hadamard_block_size):
    """Every program on the normal-range path (blocks within 11 binades of their row's largest),
    with negative zeros, an all-zero row and a NaN row among them."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(48, 128, generator=gen) * torch.exp2(torch.randint(-12, 12, (48, 1), generator=gen))
    x[::7, 5] = -0.0
    x[9] = 0.0
    x[20, 100] = float("nan")
    check(x, rounding=rounding, seed=11, hadamard_block_size=hadamard_block_size)


@pytest.mark.parametrize("n", (64, 512, 2048, 8192, 16384))
def test_cuda_tiles_give_every_thread_one_block(n):
    """A program holds whole rows and at least a warp's worth of blocks, one per thread."""
    rows, block_n, warps = _tile(n, True)
    assert block_n >= n and rows * block_n == 32 * 32 * warps or warps == MAX_WARPS


def test_far_below_blocks_are_counted_not_hidden():
    x = hard_rows(8, 128, torch.float32)
    lossy = quantize_fold_fp8(x.to(DEVICE)).lossy_per_row.cpu()
    assert lossy[4] > 0 and lossy[5] > 0 and lossy[0] == 0


def test_rejects_what_the_kernel_cannot_serve():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_fold_fp8(torch.zeros(4, 48, device=DEVICE))
    with pytest.raises(ValueError, match="hadamard_block_size 0 or 32"):
        quantize_fold_fp8(torch.zeros(4, 64, device=DEVICE), hadamard_block_size=64)


@pytest.mark.parametrize(
    "plan",
    [
        ("mxfp4", "mxfp4", "mxfp4"),
        ("iht", "iht", "iht"),
        ("oe_right", "oe_left", "iht"),
        ("oe_left", "oe_right", "oe_right"),
    ],
    ids=lambda p: "-".join(p),
)
def test_linear_gives_the_same_bits_with_operands_quantized_into_fp8(plan):
    """What the GPU does (forward X and W, dgrad's dY straight into FP8) equals what the reference
    path does (quantize, fold inside the GEMM), outputs and both gradients."""
    torch.manual_seed(0)
    unfolded = AdaHOPLinear(64, 96, bias=False, recipe="mxfp4")
    unfolded.set_plan(LayerPlan(*plan))
    folded = copy.deepcopy(unfolded)
    x = (torch.randn(40, 64) * torch.exp2(torch.randint(-6, 6, (40, 1)))).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    want = unfolded(x)
    want.square().sum().backward()
    with mock.patch.object(ops, "folds_into_fp8", lambda device, n: True):
        torch.manual_seed(1)
        got = folded(x2)
        got.square().sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(x2.grad, x.grad)
    assert torch.equal(folded.weight.grad, unfolded.weight.grad)
