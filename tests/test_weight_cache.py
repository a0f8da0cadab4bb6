"""W quantized once per optimizer step under gradient accumulation (``nn.weight_cache``): the same
losses and weights bit for bit as quantizing it on every micro-batch, eager and compiled, and the
quantize ops on W counted per step; the decisions a CUDA graph's captures take, on the CPU."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch._dynamo.testing
from torch import nn
from torch.utils.checkpoint import checkpoint

from adahop import ops
from adahop.nn import AdaHOPLinear, weight_operands_cached
from adahop.nn import weight_cache
from adahop.nn.weight_cache import MAKE, REUSE, GraphOperands

IN, HIDDEN, OUT, TOKENS = 32, 64, 96, 160  # every W shape differs from every X, dY shape
# The CPU kernels of the quantize ops (the fold op runs on CUDA only).
QUANTIZE_KERNELS = {
    "quantize_mx": ops._quantize_mx_cpu,
    "quantize_mx_tiles": ops.quantize_tiles_op._init_fn,
    "quantize_fp8_rowwise": ops._quantize_rowwise_reference,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """The compiled tests' graphs and the shapes they saw stay here: a later test that compiles
    AdaHOPLinear would otherwise recompile it with dynamic shapes."""
    yield
    torch._dynamo.reset()


class Stack(nn.Module):
    def __init__(self, recipe, recompute: bool = False) -> None:
        super().__init__()
        self.first = AdaHOPLinear(IN, HIDDEN, bias=False, recipe=recipe)
        self.second = AdaHOPLinear(HIDDEN, OUT, bias=False, recipe=recipe)
        self.recompute = recompute

    def forward(self, x):
        if self.recompute:  # activation checkpointing: backward runs the forward again
            return checkpoint(lambda t: self.second(torch.relu(self.first(t))), x, use_reentrant=False)
        return self.second(torch.relu(self.first(x)))


class WeightQuantizeCount:
    """Counts adahop quantize calls whose input is a weight (by shape: no activation has one), in
    eager and compiled code alike: the ops' CPU kernels are wrapped while the block runs."""

    def __init__(self, weights: list[torch.Tensor] | None = None) -> None:
        """``weights``: count the calls that read these tensors' memory (by shape when not given)."""
        self.weights = None if weights is None else {w.data_ptr() for w in weights}
        self.count = 0
        self._scope = contextlib.ExitStack()

    def _is_weight(self, x: torch.Tensor) -> bool:
        if self.weights is None:
            return tuple(x.shape) in ((HIDDEN, IN), (OUT, HIDDEN))
        return x.data_ptr() in self.weights

    def _counted(self, kernel):
        def counted(x, *args):
            self.count += self._is_weight(x)
            return kernel(x, *args)

        return counted

    def __enter__(self) -> WeightQuantizeCount:
        lib = self._scope.enter_context(torch.library._scoped_library("adahop", "IMPL"))
        for name, kernel in QUANTIZE_KERNELS.items():
            lib.impl(name, self._counted(kernel), "CPU")
        return self

    def __exit__(self, *exc) -> None:
        self._scope.close()


def train(
    model,
    steps: int,
    accum: int,
    cached: bool,
    input_grad: bool = False,
) -> tuple[list[torch.Tensor], list[int]]:
    """Losses of every micro-batch and the weight quantize ops of each optimizer step. ``input_grad``: the input needs a gradient, so every Wᵀ is live (compiled code
    drops the first layer's otherwise)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the stochastic-rounding keys each forward draws
    losses, counts = [], []
    for _ in range(steps):
        with WeightQuantizeCount() as count, weight_operands_cached(model) if cached else contextlib.nullcontext():
            for _ in range(accum):
                x = torch.randn(TOKENS, IN, generator=data).requires_grad_(input_grad)
                loss = model(x).square().mean()
                (loss / accum).backward()
                losses.append(loss.detach())
        counts.append(count.count)
        opt.step()
        opt.zero_grad()
    return losses, counts


def _models(recipe, recompute=False):
    torch.manual_seed(0)
    model = Stack(recipe, recompute)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("recipe", ["mxfp4_hadamard", "mxfp4", {"name": "mxfp4", "weight_blocks": "2d"}])
@pytest.mark.parametrize("recompute", [False, True])
def test_once_per_step_bit_identical(recipe, recompute):
    each, once = _models(recipe, recompute)
    losses_each, counts_each = train(each, steps=2, accum=3, cached=False)
    losses_once, counts_once = train(once, steps=2, accum=3, cached=True)
    assert all(torch.equal(a, b) for a, b in zip(losses_each, losses_once, strict=True))
    for a, b in zip(each.parameters(), once.parameters(), strict=True):
        assert torch.equal(a, b)
    # Two layers: W for the forward and Wᵀ for dgrad (one 2-D tile quantization for both), made on
    # every forward, and again by a recompute; kept, once per layer and optimizer step.
    per_forward = 1 if isinstance(recipe, dict) else 2
    forwards = 3 * (2 if recompute else 1)
    assert counts_each == [2 * per_forward * forwards] * 2
    assert counts_once == [2 * per_forward] * 2


def _compiled(model, counter):
    """``model`` with its layers compiled in place, as the trainer compiles its blocks (``fullgraph``:
    no break; static shapes, as the blocks all have one); the model's own forward, where the
    per-micro-batch decision is taken, stays eager."""
    torch._dynamo.reset()  # other tests' graphs of AdaHOPLinear.forward count against the recompile limit
    for layer in (model.first, model.second):
        layer.compile(backend=counter, fullgraph=True, dynamic=False)
    return model


@pytest.mark.parametrize(
    "recipe",
    [
        "mxfp4_hadamard",
        {"name": "mxfp4", "weight_blocks": "2d"},
        {"name": "mxfp4_hadamard", "backward_rounding": "stochastic"},
        {"name": "mxfp4_hadamard", "forward_fmt": "fp8_e4m3_rowwise"},
    ],
)
def test_compiled_layers_quantize_weights_once_per_step(recipe):
    """Compiled, each layer runs two graphs inside the block: the first micro-batch's quantizes W and
    keeps its operands, the later ones' reads them. The same numbers bit for bit as the compiled
    layers that quantize W on every micro-batch, and no recompilation after the first step."""
    each, once = _models(recipe)
    counters = [torch._dynamo.testing.CompileCounterWithBackend("aot_eager") for _ in range(2)]
    each, once = _compiled(each, counters[0]), _compiled(once, counters[1])
    losses_each, counts_each = train(each, steps=1, accum=3, cached=False, input_grad=True)
    losses_once, counts_once = train(once, steps=1, accum=3, cached=True, input_grad=True)
    assert counters[1].frame_count == 2 * counters[0].frame_count  # a variant that makes, one that reads
    with torch._dynamo.config.patch(error_on_recompile=True):
        more_each, more_counts_each = train(each, steps=1, accum=3, cached=False, input_grad=True)
        more_once, more_counts_once = train(once, steps=1, accum=3, cached=True, input_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(losses_each + more_each, losses_once + more_once, strict=True))
    for a, b in zip(each.parameters(), once.parameters(), strict=True):
        assert torch.equal(a, b)
    drawn = isinstance(recipe, dict) and recipe.get("backward_rounding") == "stochastic"
    per_forward = 1 if isinstance(recipe, dict) and "weight_blocks" in recipe else 2
    assert counts_each + more_counts_each == [2 * per_forward * 3] * 2
    # Wᵀ rounded with a key drawn per forward is made on every micro-batch; W once.
    assert counts_once + more_counts_once == [2 * (1 + 3) if drawn else 2 * per_forward] * 2


def _micro_step(model, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    (loss / 2).backward()
    return loss.detach()


def _capture(graphs: GraphOperands, first: bool):
    """What a CUDA graph's capture (``GraphedMicroStep._capture``) looks like to the layers, on the
    CPU: ``graphs`` sets their modes, the model's hook leaves them alone and the per-forward checks
    are off. The micro-step inside computes at once, as the capture and its first replay would."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(weight_cache, "capturing", return_value=True))
    graphs.before_capture(first)
    stack.callback(graphs.after_capture, first)
    return stack


@pytest.mark.parametrize("compiled", [False, True])
def test_accumulating_graph_reads_what_the_first_graph_made(compiled):
    """GraphedMicroStep's schedule, captures simulated: a warm-up step runs eagerly, the next step
    captures the first graph (W quantized, its operands held) and the accumulating graph (W's
    quantize ops absent: it reads those very tensors). The same gradients bit for bit as quantizing
    W on every micro-batch; the accumulating graph may replay only after the first graph ran on W
    as it is now."""
    model, reference = _models("mxfp4_hadamard")
    if compiled:  # compiled both: which layer draws which stochastic-rounding key is the compiled graph's
        _compiled(model, "aot_eager")
        _compiled(reference, "aot_eager")
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(TOKENS, IN, generator=data).requires_grad_() for _ in range(4)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, reference)]
    graphs = GraphOperands(model)
    for step in range(2):
        torch.manual_seed(step)
        for x in batches[2 * step : 2 * step + 2]:
            _micro_step(reference, x)
        torch.manual_seed(step)
        with weight_operands_cached(model):
            if step == 0:  # the warm-up: eagerly (compiled: traces the variant that makes and the one that reads)
                for i, x in enumerate(batches[:2]):
                    _micro_step(model, x)
                    graphs.ran(first=i == 0, replayed=False)
                assert graphs.may_replay(first=False)  # nothing captured yet: nothing to guard
            else:
                with _capture(graphs, first=True), WeightQuantizeCount() as made_first:
                    _micro_step(model, batches[2])
                graphs.ran(first=True, replayed=True)
                with _capture(graphs, first=False), WeightQuantizeCount() as made_accumulating:
                    _micro_step(model, batches[3])
                graphs.ran(first=False, replayed=True)
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert made_first.count == 4 and made_accumulating.count == 0  # W and Wᵀ of two layers, once
    assert graphs.reuses
    kept = [dict(entries) for entries in graphs.kept]
    assert all(set(entries) == {"forward", "dgrad"} for entries in kept)
    # The optimizer wrote W: the accumulating graph would read the old W's operands until the first runs.
    assert not graphs.may_replay(first=False)
    graphs.ran(first=True, replayed=True)
    assert graphs.may_replay(first=False)
    graphs.ran(first=True, replayed=False)  # a first micro-step of another shape ran eagerly
    assert not graphs.may_replay(first=False) and graphs.may_replay(first=True)
    assert all(kept.mode == weight_cache.OFF and not kept.entries for _, kept in graphs.layers)


def test_a_capture_reads_only_what_its_first_capture_made():
    """A new pair of graphs (after the late BF16 switch, or a re-capture) quantizes W in its first
    graph even where valid operands are kept; an accumulating capture after W changed, or outside
    ``weight_operands_cached``, quantizes W itself and may always replay."""
    model, _ = _models("mxfp4_hadamard")
    _compiled(model, "aot_eager")
    x = torch.randn(TOKENS, IN).requires_grad_()
    with weight_operands_cached(model):
        _micro_step(model, x)
        _micro_step(model, x)  # read what the first made: valid operands kept
        assert all(kept.mode == REUSE for _, kept in weight_cache.kept_layers(model))
        graphs = GraphOperands(model)
        with _capture(graphs, first=True), WeightQuantizeCount() as made:
            assert all(kept.mode == MAKE and not kept.entries for _, kept in graphs.layers)
            _micro_step(model, x)
        assert made.count == 4
        graphs.ran(first=True, replayed=True)
        with torch.no_grad():
            model.first.weight.mul_(2)
        with _capture(graphs, first=False), WeightQuantizeCount() as made:
            _micro_step(model, x)
        assert made.count == 4 and not graphs.reuses and graphs.may_replay(first=False)
    graphs = GraphOperands(model)
    for first in (True, False):
        with _capture(graphs, first), WeightQuantizeCount() as made:
            _micro_step(model, x)
        assert made.count == 4
    assert graphs.kept is None and not graphs.reuses


def test_stochastic_saved_weight_is_made_every_forward():
    """Wᵀ rounded with a key drawn per forward is not kept; the forward's W is."""
    recipe = {"name": "mxfp4_hadamard", "backward_rounding": "stochastic"}
    each, once = _models(recipe)
    losses_each, counts_each = train(each, steps=1, accum=3, cached=False)
    losses_once, counts_once = train(once, steps=1, accum=3, cached=True)
    assert all(torch.equal(a, b) for a, b in zip(losses_each, losses_once, strict=True))
    assert counts_each == [2 * 2 * 3]
    assert counts_once == [2 * (1 + 3)]


def test_weight_written_inside_the_step_is_quantized_again():
    """An in-place write (load_state_dict, an optimizer step) bumps W's version: the next forward
    quantizes the new W, exactly as a model that never cached."""
    model, fresh = _models("mxfp4_hadamard")
    other = Stack("mxfp4_hadamard")
    x = torch.randn(TOKENS, IN)
    with weight_operands_cached(model):
        model(x)
        model.load_state_dict(other.state_dict())
        fresh.load_state_dict(other.state_dict())
        assert torch.equal(model(x), fresh(x))
        with torch.no_grad():
            model.first.weight.mul_(2)
            fresh.first.weight.mul_(2)
        assert torch.equal(model(x), fresh(x))
        made = model.first._operand_cache.made
        model(x)
        assert model.first._operand_cache.made == made  # unchanged W: kept
    assert not model.first._operand_cache._entries  # freed when the step ends


def test_trainer_quantizes_weights_once_per_step(small_overrides, tmp_path, one_thread):
    """The trainer keeps W's operands over a step's micro-batches: the same run, bit for bit, as
    one that quantizes W on every micro-batch."""
    from adahop.nn import adahop_layers
    from adahop.train import Trainer, load_config

    def run(out, **knob):
        extra = {"recipe": "mxfp4_hadamard", "training__steps": 3, "training__grad_accum": 3, **knob}
        trainer = Trainer(load_config(None, small_overrides(out, **extra)), progress=False)
        trainer.train()
        layers = adahop_layers(trainer.model).values()
        made = sum(layer._operand_cache.made for layer in layers if "_operand_cache" in layer.__dict__)
        return trainer.model.state_dict(), made, len(layers)

    cached, made, layers = run(tmp_path / "cached")
    assert made == 3 * 2 * layers  # each step: W and Wᵀ of every layer, once
    uncached, made, _ = run(tmp_path / "uncached", training__weight_operands_once_per_step=False)
    assert made == 0
    for key, value in cached.items():
        assert torch.equal(value, uncached[key]), key


def test_trainer_compiled_blocks_quantize_weights_once_per_step(small_overrides, tmp_path, one_thread):
    """With compiled blocks the trainer quantizes each W once per optimizer step too (the first
    micro-batch's graph quantizes and keeps, the later ones' read), bit for bit the run that
    quantizes W on every micro-batch, through the late switch of the forward to BF16 (new graphs,
    which keep Wᵀ only)."""
    from adahop.nn import adahop_layers
    from adahop.train import Trainer, load_config

    steps, accum = 4, 3

    def run(out, **knob):
        extra = {
            "recipe": "mxfp4_hadamard",
            "recipe__bf16_forward_after": 0.5,  # steps 3 and 4
            "training__steps": steps,
            "training__grad_accum": accum,
            "training__compile": True,
            "training__compile_backend": "aot_eager",
            **knob,
        }
        trainer = Trainer(load_config(None, small_overrides(out, **extra)), progress=False)
        layers = adahop_layers(trainer.model).values()
        with WeightQuantizeCount([layer.weight for layer in layers]) as made:
            for _ in range(steps):  # the steps alone (no validation), counted as train() counts them
                trainer.train_step()
                trainer.step += 1
        assert all(block._compiled_call_impl is not None for block in trainer.model.layers)
        return trainer.model.state_dict(), made.count, len(layers)

    cached, made, layers = run(tmp_path / "cached")
    assert made == (2 * 2 + 2 * 1) * layers  # W and Wᵀ of every layer once a step; Wᵀ alone after the switch
    uncached, made, _ = run(tmp_path / "uncached", training__weight_operands_once_per_step=False)
    assert made == (2 * 2 + 2 * 1) * accum * layers
    for key, value in cached.items():
        assert torch.equal(value, uncached[key]), key
