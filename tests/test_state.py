"""AdaHOPLinear's ``_extra_state``: a fixed-shape int64 tensor holding plan and votes."""

import pytest
import torch

from adahop import AdaHOPLinear, end_calibration_step
from adahop.nn.state import STATE_SIZE, STRATEGY_CODES, decode_state
from adahop.policy.strategies import Strategy, plan_for_patterns


def calibrated_layer() -> AdaHOPLinear:
    torch.manual_seed(0)
    layer = AdaHOPLinear(64, 32, recipe={"name": "adahop_lv2", "calibration_steps": 2})
    for _ in range(2):
        layer(torch.randn(8, 64)).sum().backward()
        end_calibration_step(layer)  # no optimizer here: the step boundary by hand
    assert not layer.calibrating
    return layer


def test_every_strategy_has_a_code():
    assert set(STRATEGY_CODES) == {s.value for s in Strategy}


def test_extra_state_is_one_fixed_shape_tensor_updated_in_place():
    fresh = AdaHOPLinear(64, 32, recipe="adahop_lv2")
    empty = fresh.state_dict()["_extra_state"]
    assert empty.dtype == torch.int64 and empty.shape == (STATE_SIZE,)
    layer = calibrated_layer()
    state = layer.state_dict()["_extra_state"]
    assert state.shape == empty.shape
    assert layer.get_extra_state() is state  # a cached state_dict sees later updates

    fresh.load_state_dict(layer.state_dict())
    assert fresh.plan == layer.plan and fresh.plan.patterns == layer.plan.patterns
    assert fresh.votes.state_dict() == layer.votes.state_dict()


def test_legacy_dict_state_still_loads():
    plan = plan_for_patterns("row", "none", "col", "lv2")
    votes = {
        "counts": {"x": {"row": 3}, "w": {"none": 3}, "g": {"col": 3}},
        "last_seen": {"x": {"row": 3}, "w": {"none": 3}, "g": {"col": 3}},
    }
    layer = AdaHOPLinear(64, 32, recipe="adahop_lv2")
    layer.set_extra_state({"plan": plan.to_dict(), "votes": votes})
    assert layer.plan == plan and layer.votes.state_dict() == votes


def test_corrupt_state_fails_with_one_line():
    with pytest.raises(ValueError, match="expected an int64 tensor"):
        decode_state(torch.zeros(3))
    bad_version = AdaHOPLinear(64, 32, recipe="mxfp4").get_extra_state().clone()
    bad_version[0] = 99
    with pytest.raises(ValueError, match="upgrade adahop"):
        decode_state(bad_version)


def test_to_empty_rebuilds_the_hadamard_signs():
    recipe = {"name": "adahop_lv2", "hadamard_signs": True}
    reference = AdaHOPLinear(64, 32, recipe=recipe).hadamard_signs
    layer = AdaHOPLinear(64, 32, recipe=recipe, device="meta").to_empty(device="cpu")
    assert torch.equal(layer.hadamard_signs, reference)
