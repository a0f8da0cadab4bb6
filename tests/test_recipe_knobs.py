"""Numerics knobs of a recipe reach AdaHOPLinear: scale_rule, backward_rounding, weight_blocks.

Each layer is checked against fake-quantized math written out here with the reference quantizer.
"""

import pytest
import torch

from adahop import quantize_mx
from adahop.formats import SCALE_RULES, quantize_mx_tiles
from adahop.gemm import QuantSpec, prepare_weight_tiles
from adahop.nn import AdaHOPLinear, load_plan
from adahop.nn.linear import draw_rounding_seeds
from adahop.policy import ModelPlan
from adahop.policy.strategies import LayerPlan, Strategy
from adahop.recipes import Recipe
from adahop.transforms import hadamard_transform


def fq(t, *, rounding="nearest", seed=0, rotate=False, scale_rule="floor"):
    """Fake-quantize along the last dim (after the inner Hadamard transform if ``rotate``)."""
    t = t.float()
    if rotate:
        t = hadamard_transform(t)
    return quantize_mx(t, rounding=rounding, seed=int(seed), scale_rule=scale_rule).dequantize()


def run(layer, x, g, seed):
    """Forward and backward under ``torch.manual_seed(seed)``: (y, dx, dw)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def inputs(t=64, d_in=64, d_out=80):
    torch.manual_seed(0)
    x, g = torch.randn(t, d_in), torch.randn(t, d_out)
    x[:, 7] *= 25.0  # a channel outlier: block scales matter
    g[3] *= 30.0
    return x, g


# ---- scale_rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", SCALE_RULES)
def test_scale_rule_reaches_every_quantized_operand(rule):
    torch.manual_seed(1)
    layer = AdaHOPLinear(64, 96, bias=False, recipe={"name": "mxfp4", "scale_rule": rule})
    x, g = inputs(d_out=96)
    x[0, :32] = 4.0 * 2.0 ** torch.arange(-16, 16).float()  # maxima on binade edges: the rules differ there
    y, dx, dw = run(layer, x, g, seed=3)
    w = layer.weight.detach()
    torch.manual_seed(3)
    s_dgrad, s_wgrad = draw_rounding_seeds()
    assert torch.equal(y, fq(x, scale_rule=rule) @ fq(w, scale_rule=rule).T)
    dx_ref = fq(g, rounding="stochastic", seed=s_dgrad, scale_rule=rule) @ fq(w.T, scale_rule=rule).T
    dw_ref = fq(g.T, rounding="stochastic", seed=s_wgrad, scale_rule=rule) @ fq(x.T, scale_rule=rule).T
    assert torch.allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    if rule != "floor":
        assert not torch.equal(y, fq(x) @ fq(w).T)  # the rule changed the result


# ---- backward_rounding ------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_hadamard"])
def test_stochastic_backward_rounding_quantizes_the_saved_operands_with_their_own_seeds(recipe):
    rotate = recipe == "mxfp4_hadamard"
    torch.manual_seed(1)
    layer = AdaHOPLinear(64, 96, bias=False, recipe={"name": recipe, "backward_rounding": "stochastic"})
    x, g = inputs(d_out=96)
    y, dx, dw = run(layer, x, g, seed=11)
    w = layer.weight.detach()
    torch.manual_seed(11)
    s_dgrad, s_wgrad, s_xt, s_wt = draw_rounding_seeds(count=4)  # one draw, as the layer makes it
    assert len({int(s) for s in (s_dgrad, s_wgrad, s_xt, s_wt)}) == 4
    assert torch.equal(y, fq(x, rotate=rotate) @ fq(w, rotate=rotate).T)  # the forward still rounds to nearest
    sr = {"rounding": "stochastic", "rotate": rotate}
    dx_ref = fq(g, seed=s_dgrad, **sr) @ fq(w.T, seed=s_wt, **sr).T
    dw_ref = fq(g.T, seed=s_wgrad, **sr) @ fq(x.T, seed=s_xt, **sr).T
    assert torch.allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    nearest = fq(g, seed=s_dgrad, **sr) @ fq(w.T, rotate=rotate).T
    assert not torch.allclose(dx, nearest, rtol=1e-5, atol=1e-5)  # Wᵀ really was rounded stochastically

    layer.weight.grad = None
    assert all(torch.equal(a, b) for a, b in zip(run(layer, x, g, seed=11), (y, dx, dw)))  # reproducible
    layer.weight.grad = None
    assert not torch.equal(run(layer, x, g, seed=12)[1], dx)  # a new seed, new noise


# ---- weight_blocks = "2d" ---------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("backward_rounding", ["nearest", "stochastic"])
def test_2d_weight_blocks_give_forward_and_dgrad_the_same_quantized_weight(rule, backward_rounding):
    torch.manual_seed(1)
    recipe = {"name": "mxfp4", "weight_blocks": "2d", "scale_rule": rule, "backward_rounding": backward_rounding}
    layer = AdaHOPLinear(64, 80, recipe=recipe)  # out = 80: dgrad's K ends in a partial tile
    layer.weight.data[::7] *= 8.0  # rows of another magnitude: a tile's scale differs from its rows' and columns'
    x, g = inputs()
    y, dx, dw = run(layer, x, g, seed=5)
    w = layer.weight.detach()
    wq = quantize_mx_tiles(w, scale_rule=rule)[0].dequantize()
    assert not torch.equal(wq, fq(w, scale_rule=rule)) and not torch.equal(wq, fq(w.T, scale_rule=rule).T)
    torch.manual_seed(5)
    seeds = draw_rounding_seeds(count=4 if backward_rounding == "stochastic" else 2)
    x_t = (
        fq(x.T, scale_rule=rule)
        if backward_rounding == "nearest"
        else fq(x.T, rounding="stochastic", seed=seeds[2], scale_rule=rule)
    )
    assert torch.allclose(y, fq(x, scale_rule=rule) @ wq.T + layer.bias.detach(), rtol=1e-6, atol=1e-5)
    dx_ref = fq(g, rounding="stochastic", seed=seeds[0], scale_rule=rule) @ wq  # the forward's W, not requantized
    dw_ref = fq(g.T, rounding="stochastic", seed=seeds[1], scale_rule=rule) @ x_t.T
    assert torch.allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_2d_weight_operands_are_exact_transposes_and_bf16_gemms_keep_w_dense():
    w = torch.randn(80, 64)
    spec = QuantSpec()
    fwd, dgrad = prepare_weight_tiles(w, "mxfp4", "mxfp4", spec)
    w_in = fwd.quantized.dequantize_blocked()[:, :64]  # the forward's R: W blocked along in
    wt_out = dgrad.quantized.dequantize_blocked()[:, :80]  # dgrad's R: Wᵀ blocked along out
    assert wt_out.shape == (64, 80) and torch.equal(w_in, wt_out.T)
    assert not torch.equal(w_in, fq(w))  # 1-D blocks would give other values
    fwd, dgrad = prepare_weight_tiles(w, "bf16", "mxfp4", spec)
    assert fwd.dense is w and torch.equal(dgrad.quantized.dequantize_blocked()[:, :80], wt_out)


def test_unsupported_2d_weight_combinations_are_one_line_errors():
    for fields in ({"name": "adahop_lv2"}, {"name": "mxfp4_hadamard"}):
        with pytest.raises(ValueError, match="weight_blocks='2d' needs strategy='mxfp4'") as e:
            Recipe.from_dict({**fields, "weight_blocks": "2d"})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"weight_blocks='3d' is not one of \('1d', '2d'\)"):
        Recipe(weight_blocks="3d")
    with pytest.raises(ValueError, match=r"backward_rounding='sr' is not one of"):
        Recipe(backward_rounding="sr")
    # A plan that rotates W is not what a fixed mxfp4 recipe runs: refused on load; set by hand, the
    # 2-D layer fails on its first forward.
    layer = AdaHOPLinear(64, 64, recipe={"name": "mxfp4", "weight_blocks": "2d"})
    rotating = LayerPlan(Strategy.IHT, Strategy.MXFP4, Strategy.IHT)
    with pytest.raises(ValueError, match="plan entry '': its plan .* is not what recipe 'mxfp4' runs"):
        load_plan(layer, ModelPlan({"": rotating}))
    layer.set_plan(rotating)
    with pytest.raises(
        ValueError, match="2-D weight blocks need MXFP4 or BF16 forward and dgrad GEMMs, got iht and mxfp4"
    ):
        layer(torch.randn(4, 64))


def test_new_fields_default_to_todays_numerics_and_round_trip():
    r = Recipe()
    assert (r.backward_rounding, r.weight_blocks, r.scale_rule) == ("nearest", "1d", "floor")
    custom = Recipe.from_dict({"name": "mxfp4", "weight_blocks": "2d", "backward_rounding": "stochastic"})
    assert Recipe.from_dict(custom.to_dict()) == custom


@pytest.mark.parametrize("grad_fast_accum", [True, False])
def test_grad_fast_accum_reaches_the_dgrad_and_wgrad_gemms_only(grad_fast_accum, monkeypatch):
    """The forward GEMM keeps cuBLAS's fast accumulation; dgrad and wgrad take the recipe's choice
    (on CUDA's fold_fp8 route; the reference accumulates in float32 either way)."""
    from adahop import ops

    calls = []

    def spy(original):
        def call(*args, fast_accum=True, **kwargs):
            calls.append(fast_accum)
            return original(*args, fast_accum=fast_accum, **kwargs)

        return call

    monkeypatch.setattr(ops, "mx_matmul", spy(ops.mx_matmul))
    monkeypatch.setattr(ops, "folded_matmul", spy(ops.folded_matmul))
    x, g = inputs()
    layer = AdaHOPLinear(64, 80, bias=False, recipe={"name": "mxfp4_hadamard", "grad_fast_accum": grad_fast_accum})
    reference = AdaHOPLinear(64, 80, bias=False, recipe="mxfp4_hadamard")
    reference.load_state_dict(layer.state_dict())
    got = run(layer, x, g, seed=3)
    assert calls == [True, grad_fast_accum, grad_fast_accum]  # forward, then dgrad and wgrad
    assert all(torch.equal(a, b) for a, b in zip(got, run(reference, x, g, seed=3), strict=True))


def test_grad_fast_accum_is_a_boolean_knob():
    assert Recipe().grad_fast_accum is True
    assert Recipe.from_dict({"name": "adahop_lv1", "grad_fast_accum": False}).grad_fast_accum is False
    with pytest.raises(ValueError, match="grad_fast_accum='no' is not true or false"):
        Recipe(grad_fast_accum="no")


# ---- forward_gemm -----------------------------------------------------------------------------
@pytest.mark.parametrize("fold_route", [False, True])
def test_reference_forward_gemm_dequantizes_and_never_folds(fold_route, monkeypatch):
    """``forward_gemm="reference"``: the forward's product is float32 products of the dequantized
    MX operands (quantized straight into E4M3 nowhere, even where the fold_fp8 route would fold
    them), and dgrad and wgrad keep their route. On the CPU the default already computes that,
    so the two agree bit for bit."""
    from adahop import ops

    monkeypatch.setattr(ops, "folds_into_fp8", lambda *_: fold_route)  # as CUDA's fold_fp8 route decides
    calls = []

    def spy(name):
        original = getattr(ops, name)

        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(ops, name, call)

    for name in ("reference_matmul", "mx_matmul", "folded_matmul", "quantize_fold_2d"):
        spy(name)
    x, g = inputs()
    layer = AdaHOPLinear(64, 80, bias=False, recipe={"name": "mxfp4_hadamard", "forward_gemm": "reference"})
    layer(x.clone().requires_grad_())
    assert calls == ["reference_matmul"]  # X and W quantized to MX, not folded; no other product
    got = run(layer, x, g, seed=3)
    monkeypatch.setattr(ops, "folds_into_fp8", lambda *_: False)
    default = AdaHOPLinear(64, 80, bias=False, recipe="mxfp4_hadamard")
    default.load_state_dict(layer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(got, run(default, x, g, seed=3), strict=True))


def test_forward_gemm_is_validated_and_round_trips():
    assert Recipe().forward_gemm == "fastest"
    assert Recipe.from_dict({"name": "adahop_lv1", "forward_gemm": "reference"}).forward_gemm == "reference"
    with pytest.raises(ValueError, match=r"forward_gemm='cublas' is not one of \('fastest', 'reference'\)"):
        Recipe(forward_gemm="cublas")


# ---- forward_fmt ------------------------------------------------------------------------------
def fq_fmt(t, fmt, rotate=False):
    """Round-to-nearest fake quantization in element format ``fmt`` along the last dim."""
    t = hadamard_transform(t.float()) if rotate else t.float()
    return quantize_mx(t, fmt=fmt).dequantize()


@pytest.mark.parametrize(("recipe", "rotate"), [("mxfp4", False), ("mxfp4_hadamard", True)])
def test_forward_fmt_sets_the_forward_operands_format_and_leaves_the_backward_alone(recipe, rotate):
    """An 8-bit forward: Y = Q8(X) Q8(W)ᵀ, while dgrad and wgrad stay the recipe's MXFP4, bit for bit."""
    x, g = inputs()
    torch.manual_seed(1)
    eight = AdaHOPLinear(64, 80, bias=False, recipe={"name": recipe, "forward_fmt": "mxfp8_e4m3"})
    four = AdaHOPLinear(64, 80, bias=False, recipe=recipe)
    four.weight.data.copy_(eight.weight.data)
    y8, dx8, dw8 = run(eight, x, g, seed=3)
    y4, dx4, dw4 = run(four, x, g, seed=3)
    w = eight.weight.detach()
    assert torch.equal(y8, fq_fmt(x, "mxfp8_e4m3", rotate) @ fq_fmt(w, "mxfp8_e4m3", rotate).T)
    assert torch.equal(y4, fq_fmt(x, "mxfp4", rotate) @ fq_fmt(w, "mxfp4", rotate).T)
    assert (y8 - x @ w.T).abs().max() < (y4 - x @ w.T).abs().max()  # the 8-bit forward is closer
    assert torch.equal(dx8, dx4) and torch.equal(dw8, dw4)


def test_forward_fmt_is_validated_and_round_trips():
    assert Recipe().forward_fmt is None
    custom = Recipe.from_dict({"name": "adahop_lv1", "forward_fmt": "mxfp8_e4m3"})
    assert Recipe.from_dict(custom.to_dict()) == custom
    with pytest.raises(ValueError, match=r"forward_fmt='fp8' is not one of \(None, 'mxfp4', 'mxfp8_e4m3'"):
        Recipe(forward_fmt="fp8")
    with pytest.raises(ValueError, match="weight_blocks='2d' shares one quantized W") as e:
        Recipe(name="mxfp4", strategy="mxfp4", weight_blocks="2d", forward_fmt="mxfp8_e4m3")
    assert "\n" not in str(e.value)
