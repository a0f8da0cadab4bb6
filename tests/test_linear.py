"""AdaHOPLinear and convert_model: numerics against fake-quantized math written out here, state, errors."""

import copy

import pytest
import torch
from torch import nn

from adahop import quantize_mx
from adahop.gemm import QuantSpec, prepare_operand, tn_matmul
from adahop.nn import AdaHOPLinear, convert_model, load_plan, model_plan
from adahop.bench.common import saved_activation_bytes
from adahop.nn.linear import draw_rounding_seeds
from adahop.policy.strategies import LayerPlan, plan_for_patterns
from adahop.transforms import hadamard_transform

STRATEGIES = ["bf16", "mxfp4", "iht", "oe_left", "oe_right"]


def fq(t, rounding="nearest", seed=0, rotate=False):
    """Fake-quantize along the last dim, written from the method text."""
    t = t.float()
    if rotate:
        t = hadamard_transform(t)
    return quantize_mx(t, rounding=rounding, seed=seed).dequantize()


def top_rows(t, k):
    """The k rows of largest abs-max, ties to the lower row: Python's sort on (-score, row)."""
    scores = t.abs().amax(1).tolist()
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def reference_gemm(l, r, strategy, rounding="nearest", seed=0, k=4):
    """C = L @ R.T with a strategy, independent of adahop.gemm: masks instead of index ops."""
    l, r = l.float(), r.float()
    if strategy == "bf16":
        return l @ r.T
    rotate = strategy != "mxfp4"
    lrows = torch.zeros(l.shape[0], dtype=torch.bool)
    rrows = torch.zeros(r.shape[0], dtype=torch.bool)
    if strategy == "oe_left":
        lrows[top_rows(l, k)] = True
    if strategy == "oe_right":
        rrows[top_rows(r, k)] = True
    lq = fq(l * ~lrows[:, None], rounding, seed, rotate)
    rq = fq(r * ~rrows[:, None], "nearest", 0, rotate)
    c = lq @ rq.T
    c = torch.where(lrows[:, None], l @ r.T, c)
    return torch.where(rrows[None, :], l @ r.T, c)


def layer_with_plan(plan, in_f=64, out_f=96, k=4, bias=True):
    torch.manual_seed(0)
    layer = AdaHOPLinear(in_f, out_f, bias=bias, recipe={"name": "adahop_lv2", "oe_k": k})
    layer.set_plan(plan)
    return layer


def planted_input(t=64, d=64):
    x = torch.randn(t, d)
    x[5] *= 40.0  # outlier token
    x[:, 7] *= 25.0  # outlier channel
    return x


@pytest.mark.parametrize("fwd", STRATEGIES)
@pytest.mark.parametrize("dgrad", STRATEGIES)
def test_forward_and_dgrad_match_fake_quantized_math(fwd, dgrad):
    layer = layer_with_plan(LayerPlan(fwd, dgrad, "iht"))
    x = planted_input().requires_grad_()
    torch.manual_seed(123)
    y = layer(x)
    w = layer.weight.detach()
    y_ref = reference_gemm(x.detach(), w, fwd) + layer.bias.detach()
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5)

    g = torch.randn_like(y)
    g[3] *= 30.0
    y.backward(g)
    torch.manual_seed(123)
    seed = int(draw_rounding_seeds()[0])
    dx_ref = reference_gemm(g, w.T, dgrad, "stochastic", seed)
    assert torch.allclose(x.grad, dx_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.bias.grad, g.sum(0))


@pytest.mark.parametrize("wgrad", ["bf16", "mxfp4", "iht", "oe_right"])
def test_wgrad_matches_fake_quantized_math(wgrad):
    layer = layer_with_plan(LayerPlan("iht", "iht", wgrad))
    x = planted_input().requires_grad_()
    torch.manual_seed(5)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.manual_seed(5)
    seed = int(draw_rounding_seeds()[1])
    dw_ref = reference_gemm(g.T, x.detach().T, wgrad, "stochastic", seed)
    assert torch.allclose(layer.weight.grad, dw_ref, rtol=1e-5, atol=1e-5)


def bf16_rounding_bound(exact: torch.Tensor) -> torch.Tensor:
    """Largest error of a float32-accumulated GEMM rounded once to BF16: half an ulp (2**-9
    relative) plus float32 accumulation, bounded here by 2**-8 relative."""
    return 2.0**-8 * exact.abs() + 1e-30


def backward_under_autocast(layer, x, g, seed):
    """Y, dX and dW of ``layer`` under CPU BF16 autocast (the GPU trainer's setting: X, W and dY in BF16)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def test_bf16_wgrad_is_exact_and_changes_no_other_gemm_of_the_layer():
    """Issue 12: lv1 and lv2 differ only in the (col, col) wgrad, OE-right vs BF16, in layers whose
    forward is IHT and dgrad OE-left. With BF16 operands, the BF16 plan's dW must be dYᵀX of the
    unrotated, unquantized X to BF16 rounding, and Y and dX bit for bit those of the OE-right plan."""
    torch.manual_seed(0)
    x = planted_input(t=256).to(torch.bfloat16)  # an outlier channel: X is col
    g = torch.randn(256, 96, dtype=torch.bfloat16)
    g[3] *= 30.0  # an outlier token: dY is row
    out = {
        wgrad: backward_under_autocast(layer_with_plan(LayerPlan("iht", "oe_left", wgrad), bias=False), x, g, seed=9)
        for wgrad in ("oe_right", "bf16")
    }
    (y1, dx1, dw1), (y2, dx2, dw2) = out["oe_right"], out["bf16"]
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    exact = g.double().T @ x.double()
    assert ((dw2.double() - exact).abs() <= bf16_rounding_bound(exact)).all()
    assert (dw1.double() - exact).norm() / exact.norm() > 1e-2  # the OE-right dW went through MXFP4


def capture_operands(store: dict, key: tuple):
    """A forward hook that keeps a layer's input and, once backward reaches it, its output gradient."""

    def hook(module, args, y):
        store[*key, "x"] = args[0].detach()
        y.register_hook(lambda dy: store.__setitem__((*key, "dy"), dy.detach()))

    return hook


def test_lv2_changes_only_the_col_col_weight_gradients_of_a_model_and_makes_them_exact():
    """A whole model under autocast, lv1 against lv2, same weights, batch and rounding keys: every
    gradient is bit for bit the same except the weights whose wgrad lv2 runs in BF16, and those
    equal dYᵀX (float64, from the layer's own input and output gradient) to BF16 rounding."""
    from adahop.models import build_model
    from adahop.policy.strategies import plan_for_patterns

    patterns = [("col", "none", "row"), ("col", "none", "none"), ("none", "none", "row"), ("col", "none", "col")]
    grads, captured = {}, {}
    for table in ("lv1", "lv2"):
        torch.manual_seed(0)
        model = convert_model(
            build_model("tiny", vocab_size=128, dim=64, n_layers=2), {"name": "adahop_lv2", "oe_k": 8}
        )
        layers = {name: m for name, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
        for i, (name, layer) in enumerate(layers.items()):
            layer.set_plan(plan_for_patterns(*patterns[i % len(patterns)], table))
            layer.register_forward_hook(capture_operands(captured, (table, name)))
        tokens = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads[table] = {name: p.grad for name, p in model.named_parameters()}
        plans = {name + ".weight": layer.plan for name, layer in layers.items()}
    in_bf16 = {name for name, plan in plans.items() if plan.wgrad.value == "bf16"}
    assert in_bf16 and len(in_bf16) < len(plans)
    for name in grads["lv1"]:
        same = torch.equal(grads["lv1"][name], grads["lv2"][name])
        assert same is (name not in in_bf16), name
    for name in in_bf16:
        layer = name.removesuffix(".weight")
        x = captured["lv2", layer, "x"].to(torch.bfloat16).double().flatten(0, -2)
        dy = captured["lv2", layer, "dy"].double().flatten(0, -2)
        exact = dy.T @ x
        assert ((grads["lv2"][name].double() - exact).abs() <= bf16_rounding_bound(exact)).all(), name


def test_bf16_strategy_reproduces_nn_linear_exactly():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    ours = convert_model(nn.Sequential(copy.deepcopy(ref)), "bf16")[0]
    assert isinstance(ours, AdaHOPLinear)
    x1 = torch.randn(4, 16, 64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    assert torch.equal(y1, y2)
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ref.weight.grad, ours.weight.grad)
    assert torch.equal(ref.bias.grad, ours.bias.grad)


@pytest.mark.parametrize("signs", [False, True])
def test_iht_without_quantization_leaves_all_three_products_unchanged(signs):
    from adahop.transforms import random_signs

    spec = QuantSpec(fmt=None, hadamard_signs=random_signs(32, 1) if signs else None)
    torch.manual_seed(0)
    x, w, g = torch.randn(64, 96), torch.randn(48, 96), torch.randn(64, 48)
    for l, r in ((x, w), (g, w.T), (g.T, x.T)):  # forward, dgrad, wgrad in L @ R.T form
        out = tn_matmul(prepare_operand(l, "iht", "L", spec), prepare_operand(r, "iht", "R", spec), torch.float32)
        assert torch.allclose(out, l @ r.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("side", ["oe_left", "oe_right"])
def test_extracted_rows_and_columns_are_exact(side):
    layer = layer_with_plan(LayerPlan(side, "iht", "iht"), bias=False)
    x = planted_input()
    w = layer.weight.detach()
    w[11] *= 50.0  # an outlier output channel: a column of B = W.T
    y = layer(x).detach().double()
    exact = x.double() @ w.double().T
    quantized_err = (y - exact).norm() / exact.norm()
    assert quantized_err > 1e-3  # the rest went through MXFP4
    picked = y[5] if side == "oe_left" else y[:, 11]  # the outlier token row / output channel
    wanted = exact[5] if side == "oe_left" else exact[:, 11]
    assert (picked - wanted).norm() / wanted.norm() < 1e-6  # a float32 GEMM, not quantized


def test_saved_activation_memory_is_about_4x_below_bf16():
    x = torch.randn(1024, 512, dtype=torch.bfloat16, requires_grad=True)
    ref = nn.Linear(512, 512, bias=False, dtype=torch.bfloat16)
    base = saved_activation_bytes(ref, x)
    for recipe in ("mxfp4", "mxfp4_hadamard"):
        layer = convert_model(nn.Sequential(copy.deepcopy(ref)), recipe)[0]
        ours = saved_activation_bytes(layer, x)
        w_copy = 512 * 512 * (0.5 + 1 / 32)  # W quantized along out for dgrad
        ratio = base / (ours - w_copy)
        assert 3.7 < ratio < 3.8, ratio  # 2 bytes -> 0.5 + 1/32 bytes per element


@pytest.mark.parametrize("dgrad", ["oe_left", "bf16"])
def test_high_precision_wt_is_cast_again_in_backward_not_kept(dgrad):
    """dgrad's BF16 Wᵀ (a BF16 dgrad, or OE-left's other side) is cast again from the parameter in
    backward: autocast's copy of W is not kept between forward and backward (2 bytes per weight)."""
    layer = layer_with_plan(LayerPlan("iht", dgrad, "iht"), bias=False)  # in 64, out 96, float32
    x = torch.randn(64, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = saved_activation_bytes(layer, x)
    xt = 64 * (64 // 2 + 64 // 32)  # Xᵀ [in, T] in MXFP4: half a byte per element, a scale per 32
    wt = 64 * (96 // 2 + 96 // 32) if dgrad == "oe_left" else 0  # Wᵀ [in, out] in MXFP4 (OE-left's main path)
    assert kept == xt + wt  # nothing weight-sized in BF16 (it was 64 * 96 * 2 bytes more)

    g = torch.randn(64, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(g.to(y.dtype))
    if dgrad == "bf16":  # the forward's BF16 W, bit for bit
        assert torch.equal(x.grad, (g.bfloat16() @ layer.weight.bfloat16()).float())
    assert x.grad.isfinite().all() and layer.weight.grad.dtype == torch.float32


def test_state_dict_round_trip_keeps_the_plan():
    layer = layer_with_plan(plan_for_patterns("row", "none", "row", "lv2"))
    assert layer.plan.strategies() == {"forward": "oe_left", "dgrad": "oe_left", "wgrad": "iht"}
    layer(torch.randn(8, 64)).sum().backward()
    sd = layer.state_dict()
    assert set(sd) == {"weight", "bias", "_extra_state"}
    fresh = AdaHOPLinear(64, 96, recipe="adahop_lv2")
    assert fresh.calibrating
    fresh.load_state_dict(sd)
    assert fresh.plan == layer.plan
    assert torch.equal(fresh.weight, layer.weight)


def test_loads_a_plain_nn_linear_checkpoint_and_keeps_calibrating():
    ref = nn.Linear(64, 32)
    layer = AdaHOPLinear(64, 32, recipe="adahop_lv2")
    layer.load_state_dict(ref.state_dict())
    assert layer.calibrating and torch.equal(layer.weight, ref.weight)


def test_calibration_freezes_after_n_steps_and_plan_json_skips_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    convert_model(model, {"name": "adahop_lv2", "calibration_steps": 3}, filter_fn=lambda m, n: n != "2")
    assert isinstance(model[2], nn.Linear) and not isinstance(model[2], AdaHOPLinear)
    x = torch.randn(64, 64)
    x[:, 7] *= 25.0  # an outlier channel
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        assert model[0].calibrating
        model(x).square().mean().backward()
        optimizer.step()  # the step boundary: one vote per tensor, and the third freezes the plan
    assert not model[0].calibrating
    assert model[0].plan.patterns["x"] == "col"

    plan = model_plan(model)
    plan.save(tmp_path / "plan.json")
    other = convert_model(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
        "adahop_lv2",
        filter_fn=lambda m, n: n != "2",
        plan=tmp_path / "plan.json",
    )
    assert other[0].plan == model[0].plan
    with pytest.raises(ValueError, match="no entry"):
        load_plan(convert_model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))), plan)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4", "mxfp4_hadamard", "adahop_lv1", "adahop_lv2"])
def test_small_mlp_trains_with_every_recipe(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))
    convert_model(model, {"name": recipe, "calibration_steps": 5})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(256, 32)
    target = torch.sin(2 * x)
    losses = []
    for _ in range(40):
        loss = (model(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_sequence_shaped_input_and_autocast():
    layer = AdaHOPLinear(64, 32, recipe="mxfp4_hadamard")
    x = torch.randn(2, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.shape == (2, 8, 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def test_bad_inputs_get_clear_errors():
    layer = AdaHOPLinear(64, 32, recipe="mxfp4")
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        layer(torch.randn(4, 63))
    layer.weight = nn.Parameter(torch.randn(64))
    with pytest.raises(ValueError, match="2-D weight"):
        layer(torch.randn(4, 64))
    with pytest.raises(ValueError, match="unknown recipe"):
        AdaHOPLinear(64, 32, recipe="fp3")


def test_float64_input_error_names_the_layer():
    layer = AdaHOPLinear(64, 32, recipe="mxfp4", layer_id=3).double()
    with pytest.raises(
        TypeError,
        match=r"AdaHOPLinear\(in_features=64, out_features=32, layer_id=3, recipe=mxfp4\) .*got torch.float64",
    ):
        layer(torch.randn(4, 64, dtype=torch.float64))
    calibrating = AdaHOPLinear(64, 32, recipe="adahop_lv2").double()  # would quantize once frozen
    with pytest.raises(TypeError, match="float64"):
        calibrating(torch.randn(4, 64, dtype=torch.float64))
    high_precision = AdaHOPLinear(64, 32, recipe="bf16").double()  # never quantizes: float64 works
    assert high_precision(torch.randn(4, 64, dtype=torch.float64)).dtype == torch.float64


def test_converting_a_bare_linear_returns_the_converted_layer():
    linear = nn.Linear(64, 64)
    layer = convert_model(linear, "mxfp4")
    assert isinstance(layer, AdaHOPLinear) and layer.weight is linear.weight
    assert list(layer.state_dict()) == ["weight", "bias", "_extra_state"]
    assert list(model_plan(layer)) == [""]
    assert convert_model(nn.Linear(64, 64), "mxfp4", filter_fn=lambda m, name: False).__class__ is nn.Linear


def test_nan_input_propagates_to_the_outputs_it_touches():
    layer = AdaHOPLinear(64, 32, recipe="mxfp4")
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    y = layer(x)
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2, 3]]).all()
