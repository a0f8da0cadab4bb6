"""Outlier scores out of the quantize pass: every quantize kernel's recorded scores bit for bit
against the rule (``policy.selection.row_scores``), the codes unchanged by recording them, the
same rows chosen, and a layer's outputs and gradients bit-identical with a separate score pass.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py``); the layer tests
also run every kernel there by calling the ops' CUDA implementations on CPU tensors.
"""

import contextlib
import copy
from unittest import mock

import pytest
import torch

from adahop import ops
from adahop.gemm import operand
from adahop.kernels.quantize import quantize_mx_triton
from adahop.kernels.quantize_fold import quantize_fold_fp8
from adahop.kernels.quantize_tiling import QuantizeTiling
from adahop.kernels.select import top_rows_triton
from adahop.nn import AdaHOPLinear
from adahop.policy.selection import row_scores, top_rows_reference
from adahop.policy.strategies import LayerPlan

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow):RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILES = QuantizeTiling(block_m=32, block_n=32, num_warps=1)  # a row over several programs


def planted(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows over 16 binades with planted outlier rows, two rows tied for the largest abs-max
    (of opposite signs), NaNs of different payloads, -Inf, a zero row and a -0.0 row."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())
    x[4] *= 2.0**12
    x[7, 3], x[9, cols - 1] = 3.0 * 2**14, -3.0 * 2**14
    x[11, 5] = float("nan")
    x.view(torch.int32)[12, cols // 2] = -0x0040_0001  # a negative NaN, another payload
    x[13, 1] = float("-inf")
    x[14], x[15] = 0.0, -0.0
    return x.to(dtype)


def assert_rule_scores(got: torch.Tensor, t: torch.Tensor, dim: int) -> None:
    """``got`` is the rule's score of every line of ``t`` along ``dim``: float32, equal bits, NaN
    where a NaN is (of any payload)."""
    want = row_scores(t, dim).cpu()
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN scores differ"
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), "scores differ"


def scored(fn, x: torch.Tensor, **kwargs):
    """(quantized, scores) of ``fn`` with scores, after checking its codes against ``fn`` without."""
    q, s = fn(x, scores=True, **kwargs)
    plain = fn(x, **kwargs)
    for name in ("data", "scales", "row_scale", "lossy_per_row"):
        if hasattr(q, name):
            a, b = getattr(q, name), getattr(plain, name)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} changed by recording scores"
    return q, s


# (fmt, axis, hadamard_block_size, rounding, dtype): the row-wise kernel (Hadamard or stochastic
# rounding), the column-wise kernel, and the general kernel (MXFP4 round to nearest without a
# Hadamard, other formats and Hadamard sizes), in both orientations; every input dtype.
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
KERNEL_CASES = [
    ("mxfp4", -1, 32, "nearest", BF16),
    ("mxfp4", -1, 32, "stochastic", FP16),
    ("mxfp4", -1, 0, "stochastic", FP32),
    ("mxfp4", -1, 0, "nearest", BF16),
    ("mxfp4", 0, 32, "nearest", BF16),
    ("mxfp4", 0, 32, "stochastic", FP32),
    ("mxfp4", 0, 0, "stochastic", FP16),
    ("mxfp8_e4m3", -1, 64, "nearest", FP32),
    ("mxfp8_e4m3", 0, 0, "stochastic", BF16),
]


@pytest.mark.parametrize("fmt, axis, hb, rounding, dtype", KERNEL_CASES)
def test_quantize_kernels_record_the_rule_scores(fmt, axis, hb, rounding, dtype):
    """Small tiles: every row (or column) is split over several programs, whose parts meet in
    the atomic max; partial tiles at the edges."""
    x = planted(70 if axis == -1 else 128, 128, dtype)
    x = x if axis == -1 else x.t().contiguous()  # blocks along the planted rows either way
    _, s = scored(
        quantize_mx_triton,
        x.to(DEVICE),
        fmt=fmt,
        axis=axis,
        hadamard_block_size=hb,
        rounding=rounding,
        seed=5,
        tiling=SMALL_TILES,
    )
    assert_rule_scores(s, x, axis % 2)


def test_scores_of_a_strided_input():
    """The general kernel reads a transposed view in place; scores follow the blocks' axis."""
    x = planted(64, 96, torch.float32)
    for axis in (-1, 0):
        _, s = scored(quantize_mx_triton, x.t().to(DEVICE), axis=axis, tiling=SMALL_TILES)
        assert_rule_scores(s, x.t(), axis % 2)


@pytest.mark.parametrize("hb, rounding, dtype", [(32, "nearest", BF16), (32, "stochastic", FP16), (0, "nearest", FP32)])
def test_quantize_fold_kernel_records_the_rule_scores(hb, rounding, dtype):
    x = planted(40, 96, dtype)
    _, s = scored(quantize_fold_fp8, x.to(DEVICE), hadamard_block_size=hb, rounding=rounding, seed=3)
    assert_rule_scores(s, x, 1)


def test_scores_cannot_be_asked_of_both_orientations():
    from adahop.kernels.quantize import _quantize

    options = dict(block_size=32, scale_rule="floor", rounding="nearest", seed=None, hadamard_block_size=0)
    with pytest.raises(ValueError, match="one orientation"):
        _quantize(torch.zeros(32, 32, device=DEVICE), "mxfp4", rowwise=True, colwise=True, signs=None, scores=True,
                  tiling=None, **options)  # fmt: skip


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_recorded_scores_choose_the_rows_the_rule_chooses(k):
    """Planted rows, a tie across the k-th place and NaNs of two payloads: the selection kernel
    on the quantize kernel's scores picks the rule's rows, as it does on a separate pass's."""
    x = planted(64, 64, torch.bfloat16)
    x[20, 9] = x[7, 3]  # a third row tied with rows 7 and 9
    for axis in (-1, 0):
        t = x if axis == -1 else x.t().contiguous()
        _, s = quantize_mx_triton(t.to(DEVICE), axis=axis, hadamard_block_size=32, scores=True)
        want = top_rows_reference(row_scores(t, axis % 2), k)
        assert torch.equal(top_rows_triton(s, k).cpu(), want)
        assert torch.equal(want, top_rows_reference(torch.linalg.vector_norm(x, float("inf"), dim=1), k))


# ---- whole layers: scores from the quantize pass against a separate score pass ---------------
def separate_score_pass(t, spec, rotate, seed, fold, scores=False):
    """The previous path: the operand quantized without scores, its rows' scores from a
    ``vector_norm`` pass of their own (in the operand's dtype)."""
    q = QUANTIZE(t, spec, rotate, seed, fold)
    return (q, torch.linalg.vector_norm(t.detach(), float("inf"), dim=1)) if scores else q


QUANTIZE = operand._rotate_and_quantize
# Every extraction: X rows (forward OE-left), W rows (forward OE-right), dY rows (dgrad OE-left),
# Wᵀ rows (dgrad OE-right, column-wise kernel) and Xᵀ rows (wgrad OE-right, column-wise kernel).
OE_PLANS = [("oe_left", "oe_left", "oe_right"), ("oe_right", "oe_right", "oe_right")]


def run_layer(layer: AdaHOPLinear, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(1)  # the stochastic-rounding keys of dY
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def planted_layer_io(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = planted(64, 64, dtype)[:, :64].clone()
    x[11:14] = 1.0  # finite outputs to compare (the NaN and Inf rows are checked above)
    x[:, 5] *= 30.0  # an outlier channel, so Xᵀ has an outlier row
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    g[3] *= 50.0
    g[17], g[41] = g[3], -g[3]  # dY rows tied with the outlier row
    return x, g


def ops_paths(mode: str) -> contextlib.ExitStack:
    """What a layer run executes: "reference" (the ops' reference), "kernels" (every Triton
    kernel, the selection kernel included; on CPU the ops' CUDA implementations are called on
    CPU tensors, in the interpreter), "fold" (also X, W and dY straight into folded FP8, as on
    the H200)."""
    stack = contextlib.ExitStack()
    if mode == "reference":
        stack.enter_context(ops.reference_only())  # on CPU the ops run their reference anyway
    else:
        stack.enter_context(mock.patch.object(ops, "_eager_cuda", lambda t: True))
    stack.enter_context(mock.patch.object(ops, "folds_into_fp8", lambda device, n: mode == "fold"))
    return stack


@pytest.mark.parametrize("plan", OE_PLANS, ids="-".join)
@pytest.mark.parametrize("mode", ["reference", "kernels", "fold"])
def test_layer_bit_identical_with_a_separate_score_pass(plan, mode):
    """The same rows extracted, and the same outputs and gradients, bit for bit."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    layer = AdaHOPLinear(64, 96, bias=False, recipe={"name": "adahop_lv2", "oe_k": 4}).to(DEVICE, dtype)
    layer.set_plan(LayerPlan(*plan))
    old = copy.deepcopy(layer)
    x, g = (t.to(DEVICE) for t in planted_layer_io(dtype))
    chosen, select = [], ops.top_rows
    recording = mock.patch.object(ops, "top_rows", lambda s, k: chosen.append(select(s, k).cpu()) or select(s, k))
    with ops_paths(mode), recording:
        got = run_layer(layer, x, g)
        new_rows, chosen[:] = list(chosen), []
        with mock.patch.object(operand, "_rotate_and_quantize", separate_score_pass):
            want = run_layer(old, x, g)
    assert len(new_rows) == len(chosen) == 3
    assert all(torch.equal(a, b) for a, b in zip(new_rows, chosen))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="full size needs a GPU")
@pytest.mark.parametrize("shape", [(16384, 4096), (16384, 14336)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_scores_full_size(shape):
    """Thousands of programs meeting in the atomic max of each column (column-wise kernel) and
    of each row (row-wise kernel); whole rows per program (fold kernel)."""
    x = planted(*shape, torch.float32).cuda()
    x[100:132, 200] = float("nan")
    x = x.bfloat16()
    for axis in (-1, 0):
        _, s = quantize_mx_triton(x, axis=axis, hadamard_block_size=32, rounding="stochastic", seed=1, scores=True)
        assert_rule_scores(s, x, axis % 2)
    _, s = quantize_fold_fp8(x, hadamard_block_size=32, scores=True)
    assert_rule_scores(s, x, 1)
