"""``convert_model``'s one rule (``conversion_verdict``) and what it says about the layers it keeps."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from adahop import AdaHOPLinear, convert_model, get_recipe
from adahop.nn.convert import conversion_verdict


class LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def kinds(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_the_rule_in_one_function():
    r = get_recipe("mxfp4")
    assert conversion_verdict("layers.0.wq", 64, 96, r) is None
    assert conversion_verdict("output", 64, 96, r) == ""  # the LM head, by name
    assert conversion_verdict("2", 64, 96, r, exclude=["2"]) == ""
    assert conversion_verdict("a", 64, 96, r, min_features=128) == ""
    assert conversion_verdict("a", 60, 100, r) == "60->100, not whole MX blocks of 32"
    assert "subclass" in conversion_verdict("a", 64, 64, r, subclass="LoRALinear")


def test_layers_kept_for_a_reason_are_named_in_one_warning():
    model = nn.Sequential(nn.Linear(64, 64), LoRALinear(64, 64), nn.Linear(60, 100), nn.Linear(100, 64))
    with pytest.warns(UserWarning) as record:
        convert_model(model, "mxfp4")
    assert len(record) == 1
    message = str(record[0].message)
    assert message.count("\n") == 0 and "left 3 linear layers unconverted" in message
    assert "1 (LoRALinear" in message and "2 (60->100" in message and "3 (100->64" in message
    assert kinds(model) == {"0": "AdaHOPLinear", "1": "LoRALinear", "2": "Linear", "3": "Linear"}


def test_the_last_layer_of_a_sequential_is_converted_unless_named_in_exclude():
    model = convert_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 128)), "mxfp4")
    assert kinds(model) == {"0": "AdaHOPLinear", "2": "AdaHOPLinear"}  # the LM head is known by name only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # excluded by name: kept quietly, as asked
        model = convert_model(nn.Sequential(nn.Linear(64, 64), LoRALinear(64, 64)), "mxfp4", exclude=["1"])
    assert kinds(model) == {"0": "AdaHOPLinear", "1": "LoRALinear"}


def test_min_features_keeps_small_layers_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = convert_model(nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256)), "mxfp4", min_features=256)
    assert kinds(model) == {"0": "Linear", "1": "AdaHOPLinear"}


def test_a_bare_linear_follows_the_same_rule():
    assert isinstance(convert_model(nn.Linear(64, 32), "mxfp4"), AdaHOPLinear)
    with pytest.warns(UserWarning, match=r"<root> \(60->100"):
        assert type(convert_model(nn.Linear(60, 100), "mxfp4")) is nn.Linear
    layer = nn.Linear(64, 64)
    assert convert_model(layer, "mxfp4", exclude=[""]) is layer


def test_a_kept_layer_still_computes_as_before():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 60))
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = model[1](model[0](x))
    with pytest.warns(UserWarning):
        convert_model(model, "bf16")
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_an_exclude_pattern_that_matches_no_linear_layer_is_a_typo():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128))
    with pytest.raises(
        ValueError, match=r"exclude pattern 'lm_haed' matches no linear layer; names look like \['0', '1'\]"
    ):
        convert_model(model, "mxfp4", exclude=["lm_haed"])
    assert kinds(model) == {"0": "Linear", "1": "Linear"}  # nothing converted
    convert_model(model, "mxfp4", exclude=["1"])
    assert kinds(model) == {"0": "AdaHOPLinear", "1": "Linear"}
