"""An operand several GEMMs read is folded into FP8 once in a compiled graph (``ops.fold_fp8`` is a node
of its own, and the graph merges equal calls). Counted through the ``adahop::fold_fp8`` op, on the CPU
with the GEMMs sent down the Hopper route (the fold's reference stands in for the kernel), and bit for bit
the results of the eager layers, which fold on every use."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adahop import ops
from adahop.nn import AdaHOPLinear
from adahop.policy.routes import GemmRoute
from adahop.policy.strategies import LayerPlan

IN, TOKENS = 64, 128
# dY rounded to nearest: a compiled graph draws stochastic-rounding keys in another order than eager layers
NEAREST_LV2 = {"name": "adahop_lv2", "grad_rounding": "nearest"}


class FoldCount(TorchDispatchMode):
    """Calls of the fold op (eager: each one a fold kernel on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.name() == "adahop::fold_fp8"
        return func(*args, **(kwargs or {}))


@pytest.fixture
def hopper_route(monkeypatch):
    """Every MXFP4 GEMM takes the fold_fp8 route, as on an H200, computed by the references."""
    route_of = ops.route_of

    def fold_route(device, n, fmt="mxfp4", block_size=32):
        return GemmRoute.FOLD_FP8 if (fmt, block_size) == ("mxfp4", 32) else route_of(device, n, fmt, block_size)

    monkeypatch.setattr(ops, "route_of", fold_route)
    monkeypatch.setattr(ops, "folds_into_fp8", lambda device, n: True)
    monkeypatch.setattr(ops, "_kernels_for", lambda *tensors: False)  # no cuBLAS: the folded product in float32


class SharedInput(nn.Module):
    """``wq``/``wk``/``wv``: three layers reading one input."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (AdaHOPLinear(IN, IN, bias=False, recipe=NEAREST_LV2) for _ in range(3))
        for layer in (self.wq, self.wk, self.wv):
            layer.set_plan(LayerPlan("iht", "iht", "iht"))

    def forward(self, x):
        return self.wq(x) * self.wk(x) + self.wv(x)


def test_compiled_block_folds_a_shared_input_once(hopper_route):
    """Compiled, the equal quantize calls of Xᵀ merge, and so do its folds in the backward graph: one
    for the three wgrad GEMMs (each also folds its dYᵀ, each dgrad its Wᵀ); before, each GEMM folded
    inside its own op. Gradients bit for bit those of the eager layers."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    model = SharedInput()
    x = torch.randn(TOKENS, IN, requires_grad=True)
    with FoldCount() as eager:
        model(x).square().sum().backward()
    want = [p.grad.clone() for p in (x, *model.parameters())]
    x.grad = None
    model.zero_grad()
    torch.compile(model, backend=backend)(x).square().sum().backward()
    assert all(torch.equal(p.grad, w) for p, w in zip((x, *model.parameters()), want, strict=True))

    forward, backward = graphs
    folds = collections.Counter(str(n.target) for n in backward.graph.nodes if "fold_fp8" in str(n.target))
    assert folds["adahop.fold_fp8.default"] == 3 + 3 + 1
    assert eager.count == 3 * 3  # eager: Xᵀ quantized, and folded, per layer
