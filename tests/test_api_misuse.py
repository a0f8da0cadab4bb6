"""Misuse of the public API: each input that used to be accepted and silently ignored, or that
silently replaced what the caller asked for, is now done right or refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adahop import AdaHOPLinear, convert_model, end_calibration_step, get_recipe, load_plan, model_plan
from adahop.policy import ModelPlan
from adahop.policy.strategies import plan_for_patterns


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def frozen(recipe: str) -> nn.Sequential:
    """A converted model whose layers froze a plan under ``recipe`` (one calibration step)."""
    model = convert_model(two_layers(), {"name": recipe, "calibration_steps": 1})
    x = torch.randn(32, 64)
    x[:, 3] *= 30  # an outlier column: X is col-patterned
    model(x).sum().backward()
    end_calibration_step(model)  # the step boundary (no optimizer here): the one vote freezes the plans
    assert all(not m.calibrating for m in model.modules() if isinstance(m, AdaHOPLinear))
    return model


def test_convert_model_twice_with_another_recipe_is_an_error():
    model = convert_model(two_layers(), "mxfp4")
    with pytest.raises(ValueError, match="already converted with recipe 'mxfp4'.*'adahop_lv2' would not change them"):
        convert_model(model, "adahop_lv2")
    assert {m.recipe.name for m in model.modules() if isinstance(m, AdaHOPLinear)} == {"mxfp4"}


def test_convert_model_twice_with_the_same_recipe_keeps_the_layers():
    model = convert_model(two_layers(), "mxfp4")
    first = model[0]
    assert convert_model(model, get_recipe("mxfp4")) is model and model[0] is first


def test_an_adaptive_plan_in_a_state_dict_does_not_replace_a_fixed_recipe():
    lv2 = frozen("adahop_lv2")
    target = convert_model(two_layers(), "mxfp4")
    with pytest.raises(ValueError, match=r"^0\._extra_state: its plan \(forward=.*\) is not what recipe 'mxfp4' runs"):
        target.load_state_dict(lv2.state_dict())
    assert all(m.plan.forward.value == "mxfp4" for m in target.modules() if isinstance(m, AdaHOPLinear))


def test_a_plan_from_another_table_or_bf16_gemms_is_refused_on_load():
    lv1_bf16_forward = frozen("adahop_lv1_bf16_forward")  # every forward in BF16
    target = convert_model(two_layers(), "adahop_lv1")
    with pytest.raises(ValueError, match="not what recipe 'adahop_lv1' runs"):
        target.load_state_dict(lv1_bf16_forward.state_dict())
    assert all(m.calibrating for m in target.modules() if isinstance(m, AdaHOPLinear))


def test_a_plan_of_the_same_recipe_loads_and_the_recipes_bf16_gemms_apply():
    lv1 = frozen("adahop_lv1")
    same = convert_model(two_layers(), "adahop_lv1")
    same.load_state_dict(lv1.state_dict())
    assert dict(model_plan(same)) == dict(model_plan(lv1))
    # lv1's plan under lv1 + forward in BF16: what that recipe runs, so it loads, forward in BF16
    kept = convert_model(two_layers(), "adahop_lv1_bf16_forward")
    kept.load_state_dict(lv1.state_dict())
    assert all(p.forward.value == "bf16" for p in model_plan(kept).values())


def test_load_plan_refuses_a_plan_of_another_recipe_or_model():
    lv2_plan = model_plan(frozen("adahop_lv2"))
    with pytest.raises(ValueError, match="plan entry '0': its plan .* is not what recipe 'mxfp4' runs"):
        load_plan(convert_model(two_layers(), "mxfp4"), lv2_plan)
    bigger = ModelPlan({**lv2_plan, "4": plan_for_patterns("none", "none", "none", "lv2")})
    model = convert_model(two_layers(), "adahop_lv2")
    with pytest.raises(ValueError, match=r"entries for layers this model does not convert: \['4'\]"):
        load_plan(model, bigger)
    assert all(m.calibrating for m in model.modules() if isinstance(m, AdaHOPLinear))
    load_plan(model, bigger, strict=False)  # part of a plan, asked for
    assert dict(model_plan(model)) == dict(lv2_plan)


def test_a_hand_made_plan_without_patterns_is_taken_as_given():
    model = convert_model(two_layers(), "adahop_lv2")
    plan = ModelPlan({name: plan_for_patterns("none", "none", "none", "lv2") for name in ("0", "2")})
    hand = ModelPlan({name: type(p)("mxfp4", "iht", "iht") for name, p in plan.items()})
    load_plan(model, hand)
    assert model[0].plan.strategies() == {"forward": "mxfp4", "dgrad": "iht", "wgrad": "iht"}


def test_a_layers_recipe_cannot_be_swapped_after_it_is_built():
    layer = AdaHOPLinear(64, 64, recipe="mxfp4")
    with pytest.raises(AttributeError, match="fixed when the layer is built"):
        layer.recipe = get_recipe("bf16")
    assert layer.recipe.name == "mxfp4"


def test_a_model_without_linear_layers_is_named_in_a_warning():
    with pytest.warns(UserWarning, match="convert_model converted nothing: Conv1d has no nn.Linear"):
        convert_model(nn.Conv1d(4, 4, 3))


def test_a_recipe_named_like_a_registered_one_cannot_silently_run_another_strategy():
    from adahop import Recipe

    with pytest.raises(
        ValueError, match=r"recipe 'bf16': strategy='adaptive', but the registered 'bf16' has strategy='bf16'"
    ):
        Recipe(name="bf16")  # the field defaults are adaptive: it would calibrate and quantize
    assert get_recipe({"name": "bf16", "calibration_steps": 3}).strategy == "bf16"
    assert Recipe(name="my_bf16", strategy="bf16").strategy == "bf16"


def test_a_cuda_graph_of_a_calibrating_model_is_refused():
    """A captured step would replay calibration forever (the plan never freezes inside a graph)."""
    from adahop.train.graphs import GraphedMicroStep

    with pytest.raises(ValueError, match="2 layers still calibrate.*adahop.end_calibration_step"):
        GraphedMicroStep(convert_model(two_layers(), {"name": "adahop_lv2", "calibration_steps": 1}))
    assert GraphedMicroStep(frozen("adahop_lv2")).captured is False
