"""An operand several GEMMs read is folded into FP8 once (``ops.fold_fp8``): eagerly by a memo on its
packed codes, in a compiled graph by the merge of equal calls. Counted through the ``adahop::fold_fp8``
op, on the CPU with the GEMMs sent down the Hopper route (the fold's reference stands in for the kernel),
and bit for bit the results of folding on every use."""

from __future__ import annotations

import collections
import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from adahop import ops
from adahop.formats import MXTensor, quantize_mx
from adahop.kernels.fold import fold_to_fp8_reference
from adahop.nn import AdaHOPLinear
from adahop.policy.routes import GemmRoute
from adahop.policy.strategies import LayerPlan

IN, OUT, TOKENS = 64, 96, 128
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


class _NoMemo(dict):
    """``ops._folds`` that keeps nothing: every use folds again."""

    def __setitem__(self, key, value) -> None:
        pass


def same_fold(a, b) -> bool:
    return (
        torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        and torch.equal(a.row_scale, b.row_scale)
        and torch.equal(a.lossy_per_row, b.lossy_per_row)
    )


def test_an_operand_is_folded_once_while_its_codes_live():
    x = torch.randn(48, 256) * torch.exp2(torch.randint(0, 24, (48, 8)).float()).repeat_interleave(32, dim=1)
    mx = quantize_mx(x, axis=1)
    with FoldCount() as count:
        first = ops.fold_fp8(mx)
        again = ops.fold_fp8(MXTensor(mx.data, mx.scales, mx.fmt, mx.axis, mx.block_size, mx.shape))
    assert count.count == 1 and again is first
    assert same_fold(first, fold_to_fp8_reference(mx)) and first.n_lossy > 0

    # Codes written in place, or paired with other scales: folded again, as the reference folds them.
    mx.data[0].bitwise_xor_(0x11)
    rescaled = MXTensor(mx.data, mx.scales.clone(), mx.fmt, mx.axis, mx.block_size, mx.shape)
    rescaled.scales[1] -= 1
    with FoldCount() as count:
        written = ops.fold_fp8(mx)
        other = ops.fold_fp8(rescaled)
    assert count.count == 2
    assert same_fold(written, fold_to_fp8_reference(mx)) and not same_fold(written, first)
    assert same_fold(other, fold_to_fp8_reference(rescaled))

    # Under reference_only the reference folds its own; inference tensors are never kept.
    with FoldCount() as count, ops.reference_only():
        ops.fold_fp8(rescaled)
    with torch.inference_mode():
        frozen = quantize_mx(x, axis=1)
        with FoldCount() as inference:
            ops.fold_fp8(frozen)
            ops.fold_fp8(frozen)
    assert count.count == 1 and inference.count == 2

    # Weakly kept: the entry goes with the codes.
    kept = len(ops._folds)
    del mx, rescaled, first, again, written, other
    gc.collect()
    assert len(ops._folds) == kept - 1


@pytest.mark.parametrize("recompute", [False, True])
def test_weight_operand_kept_over_micro_batches_is_folded_once_per_step(hopper_route, monkeypatch, recompute):
    """Wᵀ (dgrad's R, kept over the step by ``nn.weight_cache``) is folded on the step's first backward
    only; Xᵀ and dYᵀ (wgrad) are new every micro-batch. The same losses and weights bit for bit."""
    from test_weight_cache import Stack, train

    torch.manual_seed(0)
    each = Stack("mxfp4_hadamard", recompute)
    once = copy.deepcopy(each)
    monkeypatch.setattr(ops, "_folds", _NoMemo())
    losses_each, folds_each = train(each, steps=2, accum=3, cached=True, counter=FoldCount)
    monkeypatch.setattr(ops, "_folds", WeakIdKeyDictionary())
    losses_once, folds_once = train(once, steps=2, accum=3, cached=True, counter=FoldCount)
    assert all(torch.equal(a, b) for a, b in zip(losses_each, losses_once, strict=True))
    for a, b in zip(each.parameters(), once.parameters(), strict=True):
        assert torch.equal(a, b)
    wgrad, dgrad = 2 * 2, 1  # per micro-batch: dYᵀ and Xᵀ of both layers; Wᵀ of the second (x needs no grad)
    assert folds_each == [3 * (wgrad + dgrad)] * 2
    assert folds_once == [3 * wgrad + dgrad] * 2


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


def test_eager_fold_memo_is_not_traced():
    """Under torch.compile ``ops.fold_fp8`` is a plain graph node: no memo lookup runs while tracing."""
    mx = quantize_mx(torch.randn(32, 64), axis=1)
    fold = torch.compile(lambda d, s: ops.fold_fp8(MXTensor(d, s, "mxfp4", 1, 32, (32, 64))).data, backend="eager")
    kept = len(ops._folds)
    out = fold(mx.data, mx.scales)
    assert torch.equal(out.view(torch.uint8), fold_to_fp8_reference(mx).data.view(torch.uint8))
    assert len(ops._folds) == kept
