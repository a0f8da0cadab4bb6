"""Per-GEMM ablation: ``bf16_gemms`` and ``bf16_layers`` keep GEMMs in BF16 over any plan."""

import json
import tomllib

import pytest
import torch
from torch import nn

from adahop.analysis.runs import recipe_label
from adahop.models import build_model
from adahop.nn import AdaHOPLinear, convert_model, load_plan, model_plan
from adahop.policy.calibration import ModelPlan, end_calibration_step
from adahop.policy.strategies import LayerPlan, Strategy
from adahop.recipes import Recipe, get_recipe
from adahop.train.checkpoint import CheckpointError, check_matches
from adahop.train.cli import build_parser, parse_overrides, resolve_config
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
    model(tokens, tokens)[1].backward()
    end_calibration_step(model)  # no optimizer here: the step boundary by hand
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


# ---- ROLE@PATTERN entries: one GEMM role in BF16 in a set of layers ------------------------------
def test_scoped_entries_parse_validate_and_combine():
    r = Recipe(bf16_gemms=("wgrad@*.w2", "forward@*.attention.*", "forward@layers.0.*", "dgrad"))
    assert r.bf16_gemms_for("layers.1.attention.wq") == ("forward", "dgrad")
    assert r.bf16_gemms_for("layers.0.feed_forward.w1") == ("forward", "dgrad")
    assert r.bf16_gemms_for("layers.1.feed_forward.w2") == ("dgrad", "wgrad")
    assert r.bf16_gemms_for("layers.1.feed_forward.w3") == ("dgrad",)
    assert r.bf16_gemms_for("layers.0.feed_forward.w2") == ("forward", "dgrad", "wgrad")  # GEMMS order
    assert Recipe(bf16_gemms=("forward@*", "forward")).bf16_gemms_for("w1") == ("forward",)  # no duplicates
    ffn = Recipe(bf16_gemms=("forward@*.feed_forward.*",), bf16_layers=("*.wo",))
    assert ffn.bf16_gemms_for("layers.0.attention.wq") == ()
    assert ffn.bf16_gemms_for("layers.0.attention.wo") == ("forward", "dgrad", "wgrad")  # bf16_layers: all three
    assert Recipe.from_dict(ffn.to_dict()) == ffn
    form = r"; entries are ROLE or ROLE@PATTERN \(fnmatch on module names, e\.g\. 'forward@\*\.feed_forward\.\*'\)$"
    for bad, why in (
        ("fwd@*.w2", r"bf16_gemms entry='fwd@\*\.w2': role 'fwd' is not one of \('forward', 'dgrad', 'wgrad'\)"),
        ("@*.w2", r"bf16_gemms entry='@\*\.w2': role '' is not one of"),
        ("forward@", r"bf16_gemms entry='forward@' has an empty pattern"),
        ("fwd", r"bf16_gemms entry='fwd' is not one of \('forward', 'dgrad', 'wgrad'\)"),
    ):
        with pytest.raises(ValueError, match=why + ".*" + form) as e:
            Recipe(bf16_gemms=("forward", bad))
        assert "\n" not in str(e.value)


def test_scoped_forward_is_bf16_exactly_in_the_matching_layers():
    recipe = {"name": "mxfp4", "bf16_gemms": ["forward@*.attention.*", "forward@layers.1.feed_forward.w2"]}
    model = convert_model(build_model("tiny", vocab_size=64, **SMALL_MODEL), recipe)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        kept = ".attention." in name or name == "layers.1.feed_forward.w2"
        assert layer.bf16_gemms == (("forward",) if kept else ()), name
        assert layer.plan.forward is (Strategy.BF16 if kept else Strategy.MXFP4), name
        assert layer.plan.dgrad is layer.plan.wgrad is Strategy.MXFP4, name
    with pytest.raises(ValueError, match=r"bf16_gemms entry 'forward@\*\.w9' matches no converted layer; names look"):
        convert_model(
            build_model("tiny", vocab_size=64, **SMALL_MODEL), {"name": "mxfp4", "bf16_gemms": ["forward@*.w9"]}
        )


def test_cli_override_with_patterns_and_a_distinct_run_label():
    parser = build_parser()
    args, extra = parser.parse_known_args(
        ["--recipe.bf16_gemms=forward@*.attention.*,forward@*.w2", "--recipe=adahop_lv1"]
    )
    cfg = resolve_config(args, parse_overrides(extra, parser))  # as `adahop train` and quality_h200.sh do
    assert cfg.recipe.name == "adahop_lv1"
    assert cfg.recipe.bf16_gemms == ("forward@*.attention.*", "forward@*.w2")
    saved = tomllib.loads(cfg.to_toml())["recipe"]  # the run's config.toml, as summary.py / compare read it
    assert Recipe.from_dict(saved) == cfg.recipe
    labels = {
        recipe_label(saved),
        recipe_label({**saved, "bf16_gemms": ["forward@*.feed_forward.*"]}),
        recipe_label({**saved, "bf16_gemms": ["forward"]}),
        recipe_label({**saved, "bf16_gemms": []}),
    }
    assert len(labels) == 4
    assert recipe_label(saved) == "adahop_lv1 (bf16_gemms=['forward@*.attention.*', 'forward@*.w2'])"
    with pytest.raises(ConfigError, match="role 'fwd' is not one of"):
        apply_override(cfg, "recipe.bf16_gemms", "forward@*.w2,fwd@*.w1")


def test_forward_at_star_is_bit_identical_to_forward():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for kept in ("forward", "forward@*"):
        torch.manual_seed(0)
        model = convert_model(
            build_model("tiny", vocab_size=64, **SMALL_MODEL), {"name": "mxfp4", "bf16_gemms": [kept]}
        )
        torch.manual_seed(1)
        loss = model(tokens, tokens)[1]
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_the_registered_bf16_forward_recipe_trains_as_lv1_with_the_forward_ablation(small_overrides, tmp_path):
    """docs/quality.md measured ``adahop_lv1 --recipe.bf16_gemms=forward``; the named recipe must be that run."""
    from adahop.cli import main as adahop_main
    from adahop.train.metrics import read_metrics

    def train(name: str, **extra) -> tuple[list, dict]:
        out = tmp_path / name
        argv = [f"--{k}={v}" for k, v in small_overrides(out, recipe__name=name.split("+")[0], **extra)]
        assert adahop_main(["train", *argv]) == 0
        losses = [(r["kind"], r["step"], r["loss"]) for r in read_metrics(out) if "loss" in r]
        return losses, json.loads((out / "plan.json").read_text())

    named = train("adahop_lv1_bf16_forward")
    ablated = train("adahop_lv1+fwd", recipe__bf16_gemms="forward")
    assert named == ablated
    assert {layer["forward"] for layer in named[1]["layers"].values()} == {"bf16"}
