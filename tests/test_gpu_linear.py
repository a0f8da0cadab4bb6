"""On CUDA, AdaHOPLinear runs the Triton kernels; its three GEMMs must agree with the reference.

Quantization is bit-exact between the kernels and the reference (stochastic rounding included:
both draw the same Philox noise), so the outputs differ only by GEMM accumulation order and the
final rounding to the output dtype. Skipped without a GPU (CI is CPU-only); run on the H200.
"""

import copy

import pytest
import torch
from torch import nn

from adahop import ops
from adahop.nn import AdaHOPLinear
from adahop.policy.strategies import LayerPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PLANS = [
    LayerPlan("mxfp4", "mxfp4", "mxfp4"),
    LayerPlan("iht", "iht", "iht"),
    LayerPlan("oe_left", "oe_left", "iht"),
    LayerPlan("oe_right", "oe_right", "oe_right"),
    LayerPlan("iht", "oe_left", "bf16"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, seed: int):
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = None
    torch.manual_seed(seed)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("grad_fast_accum", [True, False], ids=["fast-accum", "fp32-accum-grads"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(s.value for s in p.strategies().values()))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_kernels_match_reference_on_all_three_gemms(plan, dtype, tol, grad_fast_accum):
    torch.manual_seed(0)
    recipe = {"name": "adahop_lv2", "oe_k": 16, "grad_fast_accum": grad_fast_accum}
    layer = AdaHOPLinear(512, 384, bias=False, device="cuda", dtype=dtype, recipe=recipe)
    layer.set_plan(plan)
    x = torch.randn(1024, 512, device="cuda", dtype=dtype)
    x[:, 3] *= 30.0
    g = torch.randn(1024, 384, device="cuda", dtype=dtype)
    fast = run_layer(layer, x, g, seed=7)
    with ops.reference_only():
        ref = run_layer(copy.deepcopy(layer), x, g, seed=7)
    for name, a, b in zip(("forward", "dgrad", "wgrad"), fast, ref):
        assert rel(a, b) < tol, (name, rel(a, b))


def test_quantized_operands_are_bit_exact_with_the_reference():
    from adahop.gemm import QuantSpec, prepare_operand

    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    for strategy, rounding in (("mxfp4", "nearest"), ("iht", "stochastic")):
        spec = QuantSpec(rounding=rounding)
        for t in (x, x.t()):
            fast = prepare_operand(t, strategy, "L", spec, seed=3).quantized
            with ops.reference_only():
                ref = prepare_operand(t, strategy, "L", spec, seed=3).quantized
            assert torch.equal(fast.data, ref.data) and torch.equal(fast.scales, ref.scales)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(s.value for s in p.strategies().values()))
def test_an_8bit_forward_matches_the_reference_and_beats_the_4bit_one(plan):
    """``recipe.forward_fmt = "mxfp8_e4m3"`` on CUDA: the forward's operands in E4M3 (its GEMM on the
    reference route), dgrad and wgrad on the MXFP4 kernel routes, all three as the reference computes them."""
    torch.manual_seed(0)
    recipe = {"name": "adahop_lv1", "oe_k": 16, "forward_fmt": "mxfp8_e4m3"}
    layer = AdaHOPLinear(512, 384, bias=False, device="cuda", dtype=torch.bfloat16, recipe=recipe)
    layer.set_plan(plan)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    x[:, 3] *= 30.0
    g = torch.randn(1024, 384, device="cuda", dtype=torch.bfloat16)
    fast = run_layer(layer, x, g, seed=7)
    with ops.reference_only():
        ref = run_layer(copy.deepcopy(layer), x, g, seed=7)
    for name, a, b in zip(("forward", "dgrad", "wgrad"), fast, ref):
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    exact = x.float() @ layer.weight.float().T
    four = AdaHOPLinear(
        512, 384, bias=False, device="cuda", dtype=torch.bfloat16, recipe={**recipe, "forward_fmt": None}
    )
    four.weight.data.copy_(layer.weight.data)
    four.set_plan(plan)
    assert rel(fast[0], exact) < rel(run_layer(four, x, g, seed=7)[0], exact)  # 8 bits beat 4 in the forward
