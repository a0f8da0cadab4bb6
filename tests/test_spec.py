"""``formats.QuantSpec``, the one spec object from a recipe to the custom ops, and the frozen ``Recipe``."""

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from adahop import ops
from adahop.formats import DEFAULT_SPEC, QuantSpec
from adahop.gemm import prepare_operand
from adahop.nn import AdaHOPLinear, convert_model
from adahop.policy import ModelPlan, PatternVotes
from adahop.policy.strategies import DEFAULT_TABLE, Strategy, plan_for_patterns
from adahop.recipes import Recipe, get_recipe
from adahop.transforms import random_signs


def test_recipe_defaults_are_the_spec_defaults_and_the_default_table():
    r = Recipe()
    assert r.quant_spec(r.rounding) == DEFAULT_SPEC == QuantSpec()
    assert r.table == DEFAULT_TABLE
    for fn in (plan_for_patterns, PatternVotes.plan, ModelPlan.from_votes):
        assert inspect.signature(fn).parameters["table"].default == DEFAULT_TABLE, fn


def test_unrotated_spec_drops_the_transform_and_its_signs():
    signs = random_signs(32, 1)
    spec = QuantSpec(rounding="stochastic", hadamard_signs=signs)
    plain = spec.unrotated
    assert (plain.hadamard_block_size, plain.hadamard_signs, plain.rounding) == (0, None, "stochastic")
    assert plain.unrotated is plain
    assert spec == QuantSpec(rounding="stochastic") and hash(spec) == hash(QuantSpec(rounding="stochastic"))
    with pytest.raises(ValueError, match="only used with a hadamard_block_size"):
        QuantSpec(hadamard_block_size=0, hadamard_signs=signs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rounding = "nearest"


@pytest.mark.parametrize("strategy, hadamard", [(Strategy.MXFP4, 0), (Strategy.IHT, 32), (Strategy.OE_RIGHT, 32)])
def test_ops_receive_the_spec_the_strategy_applies(monkeypatch, strategy, hadamard):
    """A strategy that does not rotate hands ops a spec without Hadamard and without signs (the CUDA
    quantizer refuses signs without a transform)."""
    seen = []
    quantize_2d = ops.quantize_2d
    monkeypatch.setattr(ops, "quantize_2d", lambda x, spec, **kw: seen.append(spec) or quantize_2d(x, spec, **kw))
    spec = QuantSpec(hadamard_signs=random_signs(32, 1))
    prepare_operand(torch.randn(64, 32).t(), strategy, "R", spec)
    assert seen[0].hadamard_block_size == hadamard
    assert (seen[0].hadamard_signs is None) == (hadamard == 0)


def test_layers_share_one_frozen_recipe():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    recipe = get_recipe("mxfp4")
    convert_model(model, recipe, filter_fn=lambda name, module: True)
    layers = [m for m in model.modules() if isinstance(m, AdaHOPLinear)]
    assert len(layers) == 2 and all(layer.recipe is recipe for layer in layers)
    assert get_recipe("mxfp4") is recipe
    layer = layers[0]
    act, grad, saved = layer._specs
    assert (act.rounding, grad.rounding, saved.rounding) == (
        recipe.rounding,
        recipe.grad_rounding,
        recipe.backward_rounding,
    )
