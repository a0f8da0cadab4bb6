"""benchmarks/quality/gradient_error.py: each variant runs the run's weights under its own recipe,
with adaptive plans from the run's frozen patterns, and the probe's numbers are the errors it says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from adahop.nn import adahop_layers
from adahop.policy.strategies import LayerPlan, Strategy, plan_for_patterns
from adahop.train import Trainer, load_config
from adahop.train.builders import load_run

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPT = Path(__file__).parents[1] / "benchmarks" / "quality" / "gradient_error.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("gradient_error", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lv1_run(small_overrides, tmp_path_factory):
    run = tmp_path_factory.mktemp("probe") / "lv1"
    Trainer(load_config(None, small_overrides(run, recipe="adahop_lv1")), progress=False).train()
    return run


def test_variants_parse_in_the_quality_script_syntax():
    probe = load_probe()
    spec = "a:--recipe=adahop_lv1 --recipe.bf16_gemms=wgrad; b:--recipe.grad_fast_accum=false;"
    assert probe.parse_variants(spec) == {
        "a": [("recipe", "adahop_lv1"), ("recipe.bf16_gemms", "wgrad")],
        "b": [("recipe.grad_fast_accum", "false")],
    }
    with pytest.raises(SystemExit, match="'recipe=bf16' is not --key=value"):
        probe.parse_variants("x:recipe=bf16")


def test_variant_models_keep_the_weights_and_take_their_own_plans(lv1_run):
    probe = load_probe()
    run_model, cfg, _ = load_run(lv1_run)
    frozen = adahop_layers(run_model)
    variants = {
        "lv2": [("recipe", "adahop_lv2")],
        "iht": [("recipe", "mxfp4_hadamard")],
        "wgrad": [("recipe.bf16_gemms", "wgrad")],
        "acc": [("recipe.grad_fast_accum", "false")],
    }
    models = {tag: probe.variant_model(run_model, cfg, overrides, "cpu") for tag, overrides in variants.items()}
    for tag, model in models.items():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), run_model.parameters(), strict=True)), tag
    for name, layer in frozen.items():
        p = layer.plan.patterns
        assert adahop_layers(models["lv2"])[name].plan == plan_for_patterns(p["x"], p["w"], p["g"], "lv2")
        assert adahop_layers(models["iht"])[name].plan == LayerPlan.uniform(Strategy.IHT)
        assert adahop_layers(models["wgrad"])[name].plan == layer.plan.with_bf16(("wgrad",))
        assert adahop_layers(models["acc"])[name].plan == layer.plan
        assert adahop_layers(models["acc"])[name].recipe.grad_fast_accum is False


def test_the_probe_writes_the_errors_it_prints(lv1_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.json"
    argv = [str(SCRIPT), str(lv1_run), "--batches", "1", "--variants", "bf16:--recipe=bf16;lv1:", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    load_probe().main()
    report = json.loads(out.read_text())
    whole = report["whole_model"]
    assert set(whole) == {"bf16", "lv1"}
    assert 0 < whole["bf16"] < 0.05 < whole["lv1"] < 1  # BF16 rounding only; MXFP4 with SR noise
    assert f"{whole['lv1']:.4f}" in capsys.readouterr().out.splitlines()[-1]
    assert set(report["by_kind"]["lv1"]) >= {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
