"""AdaHOPLinear under torch.compile: one graph (custom ops with fake kernels), same numbers as eager."""

import copy

import pytest
import torch
from torch import nn

from adahop import convert_model
from adahop.policy.strategies import LayerPlan


def make_model(grad_rounding):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    convert_model(model, {"name": "adahop_lv2", "grad_rounding": grad_rounding})
    model[0].set_plan(LayerPlan("oe_left", "oe_right", "iht"))  # every strategy appears
    model[2].set_plan(LayerPlan("mxfp4", "bf16", "oe_right"))
    return model


@pytest.mark.parametrize("grad_rounding", ["nearest", "stochastic"])
def test_compiled_model_matches_eager_without_graph_breaks_or_recompiles(grad_rounding):
    eager = make_model(grad_rounding)
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: no breaks
    x = torch.randn(64, 64)
    for step in range(3):  # new stochastic-rounding seeds every step: must not recompile
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            y_eager, y_comp = eager(x), run(x)
            assert torch.equal(y_eager, y_comp)
            y_eager.square().sum().backward()
            y_comp.square().sum().backward()
        for a, b in zip(eager.parameters(), compiled.parameters()):
            if grad_rounding == "nearest":
                assert torch.equal(a.grad, b.grad)
            else:  # the compiled graph may draw its seeds in another order: same distribution
                assert (a.grad - b.grad).norm() / a.grad.norm() < 0.2
                assert not torch.equal(a.grad, torch.zeros_like(a.grad))


def test_fake_kernels_give_shapes_on_meta():
    from adahop import ops

    x = torch.empty(100, 70, device="meta")
    data, scales = ops.quantize_mx_op(x, "mxfp4", 0, 32, "floor", "nearest", torch.tensor(0), 0, None)
    assert data.shape == (70, 64) and scales.shape == (70, 4)
    out = ops.mx_matmul_op(
        torch.empty(8, 48, dtype=torch.uint8, device="meta"),
        torch.empty(8, 3, dtype=torch.uint8, device="meta"),
        torch.empty(5, 48, dtype=torch.uint8, device="meta"),
        torch.empty(5, 3, dtype=torch.uint8, device="meta"),
        "mxfp4", 32, torch.bfloat16,
    )
    assert out.shape == (8, 5) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backward_rounding", ["nearest", "stochastic"])
def test_2d_weight_blocks_and_stochastic_backward_compile_into_one_graph(backward_rounding):
    torch.manual_seed(0)
    recipe = {"name": "mxfp4", "weight_blocks": "2d", "backward_rounding": backward_rounding}
    eager = convert_model(nn.Linear(64, 96), recipe)  # one layer: its seeds are drawn in the same order
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    x = torch.randn(64, 64)
    for step in range(2):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for model in (eager, run):
                torch.manual_seed(step)
                model(x).square().sum().backward()
    for a, b in zip(eager.parameters(), compiled.parameters()):
        if backward_rounding == "nearest":
            assert torch.equal(a.grad, b.grad)
        else:  # the compiled backward draws dY's seeds again (Xᵀ's were used in the forward): same distribution
            assert (a.grad - b.grad).norm() / a.grad.norm() < 0.5


def test_tile_quantizer_fake_kernel_gives_shapes_on_meta():
    from adahop import ops

    x = torch.empty(100, 70, device="meta")
    shapes = [t.shape for t in ops.quantize_tiles_op(x, "mxfp4", 32, "floor", "nearest", torch.tensor(0))]
    assert shapes == [(100, 48), (100, 3), (70, 64), (70, 4)]
    real = ops.quantize_tiles_op(torch.randn(100, 70), "mxfp4", 32, "floor", "nearest", torch.tensor(0))
    assert [t.shape for t in real] == shapes


def test_compiled_block_quantizes_a_shared_input_once():
    """wq/wk/wv read one normalized X, and so do w1/w3: with equal specs their X operands are
    the same custom-op call, which the joint-graph CSE of the partitioner Inductor uses
    (min-cut) merges, in the forward (X) and in wgrad (Xᵀ). Run here with that partitioner and
    no code generation, counting quantizer calls."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from adahop import ops
    from adahop.models import build_model
    from adahop.nn import adahop_layers

    torch.manual_seed(0)
    model = convert_model(build_model("tiny", vocab_size=256), "adahop_lv2")
    for layer in adahop_layers(model).values():
        layer.set_plan(LayerPlan("iht", "iht", "iht"))
    block = model.layers[0]
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=min_cut_rematerialization_partition)
    x = torch.randn(2, 32, block.attention.wq.in_features, requires_grad=True)
    rope = model.rope_cos[:32], model.rope_sin[:32]

    calls = []
    quantize = ops._quantize_mx_cpu
    counting = lambda *args: calls.append(args[0].shape) or quantize(*args)  # noqa: E731
    with torch.library._scoped_library("adahop", "IMPL") as lib:
        lib.impl("quantize_mx", counting, "CPU")
        block(x, *rope).sum().backward()
        eager_calls, calls[:] = len(calls), []
        compiled = torch.compile(block, backend=backend)
        compiled(x, *rope).sum().backward()
    # Per block 7 layers x 6 operands eagerly; compiled, X and Xᵀ of wk, wv and w3 are shared.
    assert eager_calls == 42 and len(calls) == 42 - 6
