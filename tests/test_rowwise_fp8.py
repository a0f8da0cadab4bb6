"""Row-wise scaled FP8 (``formats.rowwise``), bit for bit against independent references: the
scale exponent from exact rational arithmetic, the elements from ``ml_dtypes.float8_e4m3fn`` on
float64 values; and the Triton kernel (interpreter on CPU) bit for bit against the reference."""

import dataclasses
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from adahop.formats.rowwise import ROWWISE_K_ALIGN, quantize_fp8_rowwise, rowwise_scale_exponent
from adahop.nn import AdaHOPLinear
from adahop.policy import end_calibration_step
from adahop.policy.strategies import GEMMS, ROLES, LayerPlan, Strategy, plan_for_patterns
from adahop.recipes import Recipe, get_recipe
from adahop.transforms import hadamard_transform

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hard_rows(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows over 60 binades, ties of E4M3 rounding, row maxima at and next to 448 * 2**k, a zero
    row, rows with a NaN and an Inf, tiny rows whose elements fall to E4M3 subnormals and zero."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=gen))
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 5] = -float("inf")
    x[3, 0] = 448.0 * 2.0**-4  # amax exactly 448 * 2**k: scale 2**k, no rounding up
    x[4, 0] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)).item()  # just above: next binade
    x[5, :] = torch.tensor([1.0 + (2 * i + 1) / 16 for i in range(cols)]).clamp(max=1.9)  # halfway ties
    x[6] = torch.exp2(torch.linspace(-40, 2, cols))  # a ramp through subnormals to zero
    x[7] *= 2.0**-120  # scale exponent clamped at -126
    x[8, ::3] = -0.0
    return x.to(dtype)


def oracle(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 bytes, float32 scales) from exact arithmetic and ml_dtypes."""
    v = x.double().numpy()
    codes, scales = [], []
    for row in v:
        if not np.isfinite(row).all():
            codes.append(np.full(row.shape, 0x7F, dtype=np.uint8))
            scales.append(np.float32("nan"))
            continue
        amax = Fraction(float(np.abs(row).max()))
        s = 0
        if amax:
            s = -200
            while amax > 448 * Fraction(2) ** s:
                s += 1
            s = min(max(s, -126), 126)
        scaled = row / 2.0**s  # exact in float64
        codes.append(scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        scales.append(np.float32(2.0**s))
    return np.stack(codes), np.array(scales, dtype=np.float32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_reference_matches_exact_scale_and_ml_dtypes(dtype):
    x = hard_rows(12, 48, dtype if dtype != torch.float16 else torch.float32)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4).nan_to_num(nan=float("nan"))
        x[7] = x[7] * 2.0**100  # bring it back into float16's range
    x = x.to(dtype)
    got = quantize_fp8_rowwise(x)
    want_codes, want_scales = oracle(x.float())
    assert torch.equal(got.data.view(torch.uint8), torch.from_numpy(want_codes))
    assert torch.equal(got.row_scale.view(torch.int32), torch.from_numpy(want_scales).view(torch.int32))


def test_scale_uses_the_whole_top_binade_and_never_saturates():
    x = hard_rows(12, 48)
    q = quantize_fp8_rowwise(x)
    finite = torch.isfinite(x).all(1) & (x.abs().amax(1) > 0) & (q.row_scale > 2.0**-126)
    top = q.data.float().abs().amax(1)[finite]
    assert (top >= 224).all() and (top <= 448).all()  # (224, 448] before rounding
    assert torch.equal(rowwise_scale_exponent(torch.tensor([448.0, 449.0, 224.0, 0.0])), torch.tensor([0, 1, -1, 0]))


def test_pads_k_and_dequantizes_exactly():
    x = torch.randn(5, 20)
    q = quantize_fp8_rowwise(x)
    assert q.shape == (5, 32) and not q.data[:, 20:].float().any()
    exact = (
        torch.from_numpy(oracle(x)[0].view(ml_dtypes.float8_e4m3fn).astype(np.float64)) * q.row_scale.double()[:, None]
    )
    assert torch.equal(q.dequantize()[:, :20].double(), exact)
    assert ROWWISE_K_ALIGN == 16


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("cols", (48, 100))
def test_triton_kernel_matches_reference(dtype, cols):
    from adahop.kernels.quantize_rowwise import quantize_fp8_rowwise_triton

    x = hard_rows(12, cols).to(dtype)
    want = quantize_fp8_rowwise(x)
    got, scores = quantize_fp8_rowwise_triton(x.to(DEVICE), scores=True)
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8))
    assert torch.equal(got.row_scale.cpu().view(torch.int32), want.row_scale.view(torch.int32))
    want_scores = torch.linalg.vector_norm(x.float(), float("inf"), dim=1)
    assert torch.equal(scores.cpu(), want_scores) or torch.allclose(scores.cpu(), want_scores, equal_nan=True)


def test_triton_kernel_walks_many_programs_and_chunks():
    from adahop.kernels.quantize_rowwise import quantize_fp8_rowwise_triton

    x = hard_rows(12, 100)
    want = quantize_fp8_rowwise(x)
    got = quantize_fp8_rowwise_triton(x.to(DEVICE), block_r=4, block_k=32)  # 3 programs, 4 chunks a row
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8))
    assert torch.equal(got.row_scale.cpu().view(torch.int32), want.row_scale.view(torch.int32))


# ---- the forward GEMM in row-wise FP8 (Recipe.forward_fmt) ------------------------------------
ROWWISE = "fp8_e4m3_rowwise"


def fq_rows(t, rotate=False):
    """Row-wise FP8 fake quantization (after the inner Hadamard transform if ``rotate``)."""
    t = hadamard_transform(t.float()) if rotate else t.float()
    return quantize_fp8_rowwise(t).dequantize()[:, : t.shape[1]]


def run(layer, x, g, seed=3):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def layer_pair(recipe, **fields):
    """(a layer with the forward in row-wise FP8, the same layer in the recipe's format), same weight."""
    torch.manual_seed(1)
    fp8 = AdaHOPLinear(64, 80, bias=False, recipe={"name": recipe, "forward_fmt": ROWWISE, **fields})
    mx = AdaHOPLinear(64, 80, bias=False, recipe={"name": recipe, **fields})
    mx.weight.data.copy_(fp8.weight.data)
    return fp8, mx


def inputs():
    torch.manual_seed(0)
    x, g = torch.randn(48, 64), torch.randn(48, 80)
    x[:, 7] *= 25.0
    x[5] *= 40.0  # an outlier token
    return x, g


@pytest.mark.parametrize(("recipe", "rotate"), [("mxfp4", False), ("mxfp4_hadamard", True)])
def test_rowwise_forward_is_the_product_of_the_quantized_operands_and_leaves_the_backward_alone(recipe, rotate):
    x, g = inputs()
    fp8, mx = layer_pair(recipe)
    y8, dx8, dw8 = run(fp8, x, g)
    _, dx4, dw4 = run(mx, x, g)
    w = fp8.weight.detach()
    assert torch.equal(y8, fq_rows(x, rotate) @ fq_rows(w, rotate).T)
    assert torch.equal(dx8, dx4) and torch.equal(dw8, dw4)


def test_rowwise_forward_composes_with_outlier_extraction_and_bf16_gemms():
    x, g = inputs()
    fp8, _ = layer_pair("adahop_lv1", oe_k=4)
    fp8.set_plan(LayerPlan("oe_left", "iht", "iht"))
    y = run(fp8, x, g)[0]
    w = fp8.weight.detach()
    top = torch.sort(torch.topk(x.abs().amax(1), 4).indices).values
    want = fq_rows(x, True) @ fq_rows(w, True).T
    want[top] = x[top] @ w.T  # the extracted tokens' outputs from the BF16 path
    assert 5 in top.tolist() and torch.equal(y, want)

    kept, _ = layer_pair("mxfp4", bf16_gemms=("forward",))
    assert torch.equal(run(kept, x, g)[0], x @ kept.weight.detach().T)


def test_fp8_forward_recipe_plans_plain_fp8_forward_and_the_lv1_backward():
    r = get_recipe("adahop_lv1_fp8_forward")
    assert (r.forward_fmt, r.forward_strategy, r.table, r.grad_rounding) == (ROWWISE, "mxfp4", "lv1", "stochastic")
    layer = AdaHOPLinear(64, 80, bias=False, recipe=dataclasses.replace(r, calibration_steps=1))
    x, g = inputs()
    run(layer, x, g)  # calibrates: one step's votes
    end_calibration_step(layer)  # the step boundary: the plan freezes
    table = dict(zip(GEMMS, plan_for_patterns(*(layer.plan.patterns[k] for k in ROLES), "lv1").strategies().values()))
    assert layer.plan.forward is Strategy.MXFP4 and (layer.plan.dgrad, layer.plan.wgrad) == (
        table["dgrad"],
        table["wgrad"],
    )
    y = run(layer, x, g)[0]
    assert torch.equal(y, fq_rows(x) @ fq_rows(layer.weight.detach()).T)


def test_rowwise_forward_is_validated():
    with pytest.raises(ValueError, match="rounds to nearest") as e:
        Recipe(forward_fmt=ROWWISE, rounding="stochastic")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="forward_strategy='hadamard' is not one of"):
        Recipe(forward_strategy="hadamard")
    assert Recipe.from_dict(get_recipe("adahop_lv1_fp8_forward").to_dict()) == get_recipe("adahop_lv1_fp8_forward")


def test_rowwise_forward_compiles_with_the_op_as_one_node():
    x, g = inputs()
    fp8, _ = layer_pair("mxfp4", grad_rounding="nearest")  # no noise: eager and compiled draw seeds alike or not
    want = [t.clone() for t in run(fp8, x, g)]
    fp8.weight.grad = None
    compiled = torch.compile(fp8, backend="aot_eager", fullgraph=True)
    got = run(compiled, x, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fast_accum", (True, False))
def test_cuda_gemm_of_rowwise_operands_matches_float64(fast_accum):
    """On Hopper ``folded_matmul`` of two row-wise FP8 operands runs cuBLAS's row-wise ``_scaled_mm``;
    with a float32 output it matches the float64 product of the dequantized operands to the FP8 MMA's
    accumulation (split accumulation measured 3.0e-4 relative on the H200 here, fast below 1e-3)."""
    from adahop import ops
    from adahop.policy.routes import GemmRoute

    x, w = torch.randn(512, 1024, device="cuda"), torch.randn(768, 1024, device="cuda")
    x[:, 3] *= 50.0
    qx, qw = quantize_fp8_rowwise(x), quantize_fp8_rowwise(w)
    assert ops.route_of(x.device, 768, ROWWISE) == GemmRoute.FOLD_FP8
    got = ops.folded_matmul(qx, qw, torch.float32, fast_accum=fast_accum).double()
    want = qx.dequantize().double() @ qw.dequantize().double().T
    assert ((got - want).norm() / want.norm()).item() < 1e-3
