"""W quantized once per optimizer step under gradient accumulation (``nn.weight_cache``): the same
losses and weights bit for bit as quantizing it on every micro-batch, and the quantize ops on W
counted per step."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from adahop.nn import AdaHOPLinear, weight_operands_cached

IN, HIDDEN, OUT, TOKENS = 32, 64, 96, 160  # every W shape differs from every X, dY shape
QUANTIZE_OPS = ("quantize_mx", "quantize_fold_fp8", "quantize_mx_tiles", "quantize_fp8_rowwise")


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


class WeightQuantizeCount(TorchDispatchMode):
    """Counts adahop quantize ops whose input is a weight (by shape: no activation has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "adahop" and func._opname in QUANTIZE_OPS:
            self.count += tuple(args[0].shape) in ((HIDDEN, IN), (OUT, HIDDEN))
        return func(*args, **(kwargs or {}))


def train(
    model, steps: int, accum: int, cached: bool, counter: type[TorchDispatchMode] = WeightQuantizeCount
) -> tuple[list[torch.Tensor], list[int]]:
    """Losses of every micro-batch and the ops ``counter`` counts (the weight quantize ops) in each
    optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the stochastic-rounding keys each forward draws
    losses, counts = [], []
    for _ in range(steps):
        with counter() as count, weight_operands_cached(model) if cached else contextlib.nullcontext():
            for _ in range(accum):
                x = torch.randn(TOKENS, IN, generator=data)
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
