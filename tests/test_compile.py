"""AdaHOPLinear under torch.compile: one graph (custom ops with fake kernels), same numbers as eager.

Stochastic rounding keys are where compiled and eager differ, and only in which layer gets
which key. ``draw_rounding_seeds`` is a ``torch.randint`` in the traced forward; the min-cut
partitioner (which ``aot_eager`` and Inductor use) does not count ``aten.randint`` among the
random ops it must not recompute, so it re-runs the draw in the backward wherever the backward
needs dY's keys: a layer whose forward uses none of its keys draws them in the backward, where
the layers run in reverse order (two layers swap keys); a layer whose forward uses Xᵀ's key
(``backward_rounding="stochastic"``) draws all four twice, so dY's come from the next generator
state. Either way each key is a fresh draw from torch's generator, just not the one eager hands
that layer. The tests below therefore record the key each stochastic quantize call receives in
the compiled run and hand the same keys to the eager run (``SeedReplay``): with equal keys the
two must agree bit for bit, gradients included.
"""

import copy

import pytest
import torch
from torch import nn

from adahop import convert_model, ops
from adahop.policy.strategies import LayerPlan


class SeedReplay:
    """Overrides the CPU quantizer for a test: records the Philox key of every stochastic call
    under (shape, strides, axis), and in ``replay`` mode substitutes the recorded key of the call
    with the same signature, so an eager run uses exactly the keys a compiled run used."""

    def __init__(self, lib):
        self.keys, self.replaced, self.replay = {}, {}, False
        lib.impl("quantize_mx", self._quantize, "CPU")

    def _quantize(self, x, fmt, axis, block_size, scale_rule, rounding, seed, *rest):
        if rounding == "stochastic":
            call = (tuple(x.shape), x.stride(), axis)
            if self.replay:
                self.replaced[call] = int(seed)
                seed = torch.tensor(self.keys[call])
            else:
                assert call not in self.keys, f"two stochastic calls look alike: {call}"
                self.keys[call] = int(seed)
        return ops._quantize_mx_cpu(x, fmt, axis, block_size, scale_rule, rounding, seed, *rest)

    def start(self, replay: bool):
        self.replay = replay
        (self.replaced if replay else self.keys).clear()


@pytest.fixture
def seed_replay():
    with torch.library._scoped_library("adahop", "IMPL") as lib:
        yield SeedReplay(lib)


def make_model(grad_rounding):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    convert_model(model, {"name": "adahop_lv2", "grad_rounding": grad_rounding})
    model[0].set_plan(LayerPlan("oe_left", "oe_right", "iht"))  # every strategy appears
    model[2].set_plan(LayerPlan("mxfp4", "bf16", "oe_right"))
    return model


@pytest.mark.parametrize("grad_rounding", ["nearest", "stochastic"])
def test_compiled_model_matches_eager_without_graph_breaks_or_recompiles(grad_rounding, seed_replay):
    eager = make_model(grad_rounding)
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # fullgraph: no breaks
    x = torch.randn(64, 64)
    used = []
    for step in range(3):  # new stochastic-rounding seeds every step: must not recompile
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            torch.manual_seed(step)
            seed_replay.start(replay=False)
            y_comp = run(x)
            y_comp.square().sum().backward()
            torch.manual_seed(step)
            seed_replay.start(replay=True)
            y_eager = eager(x)
            y_eager.square().sum().backward()
        assert torch.equal(y_eager, y_comp)
        for a, b in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(a.grad, b.grad)
        # Same generator state, so the same draws, handed to the layers in another order.
        assert sorted(seed_replay.keys.values()) == sorted(seed_replay.replaced.values())
        used += seed_replay.keys.values()
    # wgrad of both layers rounds dY stochastically (layer 0 has no dgrad, layer 2's is BF16).
    assert len(used) == (6 if grad_rounding == "stochastic" else 0) and len(set(used)) == len(used)


def test_dynamic_shapes_compile_and_match_eager():
    """A batch of another length (the last batch of an epoch, a run with ``dynamic=True``) makes the
    token count symbolic; the GEMM route depends on it only through a guard on its divisibility."""
    eager = make_model("nearest")
    run = torch.compile(copy.deepcopy(eager), backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (64, 96):
        x = torch.randn(tokens, 64)
        assert torch.equal(run(x), eager(x))


def test_fake_kernels_give_shapes_on_meta():
    from adahop import ops

    x = torch.empty(100, 70, device="meta")
    data, scales, scores = ops.quantize_mx_op(x, "mxfp4", 0, 32, "floor", "nearest", torch.tensor(0), 0, None, True)
    assert data.shape == (70, 64) and scales.shape == (70, 4) and scores.shape == (70,)
    out = ops.mx_matmul_op(
        torch.empty(8, 48, dtype=torch.uint8, device="meta"),
        torch.empty(8, 3, dtype=torch.uint8, device="meta"),
        torch.empty(5, 48, dtype=torch.uint8, device="meta"),
        torch.empty(5, 3, dtype=torch.uint8, device="meta"),
        "mxfp4",
        32,
        torch.bfloat16,
        True,
    )
    assert out.shape == (8, 5) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backward_rounding", ["nearest", "stochastic"])
def test_2d_weight_blocks_and_stochastic_backward_compile_into_one_graph(backward_rounding, seed_replay):
    torch.manual_seed(0)
    recipe = {"name": "mxfp4", "weight_blocks": "2d", "backward_rounding": backward_rounding}
    eager = convert_model(nn.Linear(64, 96), recipe)
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    x = torch.randn(64, 64)
    inputs = {False: x.clone().requires_grad_(), True: x.clone().requires_grad_()}  # dgrad too
    for step in range(2):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for model, replay in ((run, False), (eager, True)):
                torch.manual_seed(step)
                seed_replay.start(replay)
                model(inputs[replay]).square().sum().backward()
        # dY for dgrad and wgrad, and with stochastic backward rounding the saved Xᵀ (the saved
        # Wᵀ is the forward's 2-D tiles, rounded to nearest).
        assert len(seed_replay.keys) == (3 if backward_rounding == "stochastic" else 2)
    assert torch.equal(inputs[True].grad, inputs[False].grad)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a.grad, b.grad)


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


def test_compiled_block_takes_outlier_scores_from_its_quantize_ops():
    """Every layer of a block extracting outliers (forward X, dgrad dY, wgrad Xᵀ): one graph,
    compiled once (new stochastic-rounding keys every step), no separate score pass in it, and
    an input shared by layers that all extract from it (X and Xᵀ of wq/wk/wv, of w1/w3) still
    quantized, and its rows selected, once. Where one of them does not extract, its plain call
    and the others' scored call stay apart: one more quantization of that input."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from adahop.models import build_model
    from adahop.nn import adahop_layers

    torch.manual_seed(0)
    model = convert_model(build_model("tiny", vocab_size=256), "adahop_lv2")
    block = model.layers[0]
    x = torch.randn(2, 32, block.attention.wq.in_features, requires_grad=True)
    rope = model.rope_cos[:32], model.rope_sin[:32]
    graphs = []
    compiler = lambda gm, _: graphs.append(str(gm.graph)) or gm  # noqa: E731
    backend = aot_autograd(fw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)

    def count_calls(wk_plan: LayerPlan) -> tuple[int, int, int, int]:
        """(quantize calls recording scores, plain ones, selections) of one compiled step, and
        the eager quantize calls."""
        for layer in adahop_layers(model).values():
            layer.set_plan(LayerPlan("oe_left", "oe_left", "oe_right"))
        block.attention.wk.set_plan(wk_plan)
        calls, selections = [], []
        quantize, select = ops._quantize_mx_cpu, ops.top_rows_reference
        with torch.library._scoped_library("adahop", "IMPL") as lib:
            lib.impl("quantize_mx", lambda *args: calls.append(args[-1]) or quantize(*args), "CPU")
            lib.impl("top_rows", lambda *args: selections.append(1) or select(*args), "CPU")
            block(x, *rope).sum().backward()
            eager, calls[:], selections[:] = len(calls), [], []
            torch._dynamo.reset()
            compiled = torch.compile(block, backend=backend, fullgraph=True)
            for step in range(2):
                with torch._dynamo.config.patch(error_on_recompile=step > 0):
                    compiled(x, *rope).sum().backward()
        return calls.count(True) // 2, calls.count(False) // 2, len(selections) // 2, eager

    # Per layer X, Xᵀ and dY record scores, W, Wᵀ and dYᵀ do not; compiled, X and Xᵀ of wk, wv
    # and w3 are shared.
    assert count_calls(LayerPlan("oe_left", "oe_left", "oe_right")) == (21 - 6, 21, 21 - 6, 42)
    assert graphs and not any("vector_norm" in g for g in graphs)
    # wk's forward X plain (IHT): wq's and wv's scored X merge with each other, not with it.
    assert count_calls(LayerPlan("iht", "oe_left", "oe_right")) == (20 - 5, 22, 20 - 5, 42)
