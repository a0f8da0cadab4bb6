"""Per-GEMM ablation: ``bf16_gemms`` and ``bf16_layers`` keep GEMMs in BF16 over any plan."""

import pytest
import torch
from torch import nn

from adahop.models import build_model
from adahop.nn import AdaHOPLinear, convert_model, load_plan, model_plan
from adahop.policy.calibration import ModelPlan
from adahop.policy.strategies import LayerPlan, Strategy
from adahop.recipes import Recipe, get_recipe
from adahop.train.checkpoint import CheckpointError, check_matches
from adahop.train.config import ConfigError, TrainConfig, apply_override

from conftest import SMALL_MODEL


def _grads(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("kept", ["forward", "dgrad", "wgrad"])
def test_a_kept_gemm_matches_nn_linear_while_the_others_stay_quantized(kept):
    torch.manual_seed(0)
    ref = nn.Linear(64, 32, bias=False)
    layer = AdaHOPLinear.from_linear(nn.Linear(64, 32, bias=False), get_recipe("mxfp4"))
    layer.weight.data.copy_(ref.weight.data)
    ablated = AdaHOPLinear.from_linear(
        nn.Linear(64, 32, bias=False), Recipe.from_dict({"name": "mxfp4", "bf16_gemms": [kept]})
    )
    ablated.weight.data.copy_(ref.weight.data)
    x, g = torch.randn(48, 64), torch.randn(48, 32)
    exact = _grads(ref, x, g)
    torch.manual_seed(1)
    quantized = _grads(layer, x, g)
    torch.manual_seed(1)
    got = _grads(ablated, x, g)
    for i, name in enumerate(("forward", "dgrad", "wgrad")):
        want = exact[i] if name == kept else quantized[i]
        assert torch.equal(got[i], want), name
        assert not torch.equal(quantized[i], exact[i])  # the quantized GEMMs really differ
    assert getattr(ablated.plan, kept) is Strategy.BF16


def test_overrides_apply_after_the_adaptive_plan_freezes_and_are_saved_in_the_plan():
    recipe = Recipe.from_dict(
        {"name": "adahop_lv1", "calibration_steps": 1, "bf16_gemms": ["wgrad"], "bf16_layers": ["layers.0.*"]}
    )
    model = convert_model(build_model("tiny", vocab_size=64, **SMALL_MODEL), recipe)
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(tokens, tokens)[1].backward()
    plan = model_plan(model)
    assert len(plan) == len([m for m in model.modules() if isinstance(m, AdaHOPLinear)])
    for name, layer_plan in plan.items():
        assert layer_plan.wgrad is Strategy.BF16
        assert layer_plan.patterns is not None  # calibration still ran
        if name.startswith("layers.0."):
            assert layer_plan.all_bf16
    assert not all(p.all_bf16 for n, p in plan.items() if n.startswith("layers.1."))
    # A saved plan without the overrides loads with them still in force.
    fresh = convert_model(build_model("tiny", vocab_size=64, **SMALL_MODEL), recipe)
    load_plan(fresh, ModelPlan({n: LayerPlan.uniform("mxfp4") for n in plan}))
    assert all(p.wgrad is Strategy.BF16 for p in model_plan(fresh).values())


def test_bad_ablation_values_are_one_line_errors_listing_the_choices():
    with pytest.raises(ValueError, match=r"bf16_gemms entry='fwd' is not one of \('forward', 'dgrad', 'wgrad'\)"):
        Recipe(bf16_gemms=("fwd",))
    cfg = TrainConfig()
    apply_override(cfg, "recipe.bf16_gemms", "dgrad,wgrad")
    apply_override(cfg, "recipe.bf16_layers", "*.w2")
    assert cfg.recipe.bf16_gemms == ("dgrad", "wgrad") and cfg.recipe.bf16_layers == ("*.w2",)
    assert Recipe.from_dict(cfg.recipe.to_dict()) == cfg.recipe
    with pytest.raises(ConfigError, match="not one of"):
        apply_override(cfg, "recipe.bf16_gemms", "wgard")
    with pytest.raises(ValueError, match=r"pattern '\*\.w9' matches no converted layer; names look like \['layers.0"):
        convert_model(build_model("tiny", vocab_size=64, **SMALL_MODEL), {"name": "mxfp4", "bf16_layers": ["*.w9"]})


def test_a_checkpoint_written_before_the_ablation_fields_still_matches_its_config(tmp_path):
    current = TrainConfig().to_dict()
    saved = {**current, "recipe": {k: v for k, v in current["recipe"].items() if not k.startswith("bf16_")}}
    check_matches(tmp_path / "old.pt", saved, current)
    with pytest.raises(CheckpointError, match="bf16_gemms"):
        check_matches(tmp_path / "old.pt", saved, {**current, "recipe": {**current["recipe"], "bf16_gemms": ["wgrad"]}})
