"""adahop.integrations.torchtitan on CPU: conversion, forward, calibration, plan in DCP checkpoints.

torchtitan's FlexAttention has no CPU backward, so the training test swaps the compiled
flex-attention call for causal SDPA (the mask FlexAttention applies to one-document sequences).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

pytest.importorskip("torchtitan")
titan = pytest.importorskip("adahop.integrations.torchtitan")

from adahop import DEFAULT_RECIPE, AdaHOPLinear, model_plan  # noqa: E402

pytestmark = pytest.mark.skipif(titan.API != "0.3", reason="torchtitan 0.3 API tests")

if titan.API == "0.3":
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import llama3_configs, model_registry

    from adahop.integrations.torchtitan import AdaHOPConverter, AdaHOPTitanLinear

VOCAB = 2048  # the debug model's


def build(config):
    """What torchtitan's trainer does: build on meta, to_empty, init_states."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.verify_module_protocol()
    return model


def run(model, tokens):
    """A forward with a causal block mask built eagerly (torchtitan's own is compiled: slow on CPU)."""
    b, n = tokens.shape
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, b, None, n, n, device="cpu")
    return model(tokens, torch.arange(n).expand_as(tokens), mask)


def causal_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None


@pytest.fixture
def eager_attention(monkeypatch):
    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", causal_sdpa)


def test_converter_swaps_block_linears_and_keeps_the_lm_head():
    spec = model_registry("debugmodel", converters=[AdaHOPConverter.Config(exclude=["wo"])])
    kinds = {fqn: type(cfg) for fqn, cfg, _, _ in spec.model.traverse(Linear.Config)}
    assert kinds.pop("lm_head") is Linear.Config
    assert {k for fqn, k in kinds.items() if fqn.endswith(".wo")} == {Linear.Config}
    converted = [fqn for fqn, k in kinds.items() if k is AdaHOPTitanLinear.Config]
    assert len(converted) == 6 * 4  # wqkv, w1, w2, w3 of each of the 6 blocks

    model = build(spec.model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
    assert sorted(layers) == sorted(converted)
    assert sorted(m.layer_id for m in layers.values()) == list(range(len(converted)))
    assert all(m.calibrating and m.recipe.name == DEFAULT_RECIPE for m in layers.values())
    assert {m.bf16_gemms for m in layers.values()} == {("forward",)}  # the default's, through the converter

    small = model_registry("debugmodel", converters=[AdaHOPConverter.Config(min_features=512)])
    assert not any(type(c) is AdaHOPTitanLinear.Config for _, c, _, _ in small.model.traverse(Linear.Config))
    with pytest.raises(ValueError, match="unknown recipe"):
        AdaHOPConverter.Config(recipe="nope").build()
    with pytest.raises(ValueError, match="exclude pattern 'w0' matches no linear layer"):
        model_registry("debugmodel", converters=[AdaHOPConverter.Config(exclude=["w0"])])


def test_converter_applies_convert_models_rule_and_names_the_layers_it_keeps():
    """One rule (``nn.convert.conversion_verdict``): a subclass of Linear and a layer that is not whole MX
    blocks stay Linear, named in one warning, as under ``convert_model``."""
    from dataclasses import dataclass, fields

    @dataclass(kw_only=True, slots=True)
    class OwnLinear(Linear.Config):
        pass

    config = debug_config(1)
    found = {fqn: (cfg, parent, attr) for fqn, cfg, parent, attr in config.traverse(Linear.Config)}
    w1, parent, attr = found["layers.0.feed_forward.w1"]
    setattr(parent, attr, OwnLinear(**{f.name: getattr(w1, f.name) for f in fields(w1)}))
    found["layers.0.feed_forward.w2"][0].in_features = 300  # >= min_features, not whole blocks
    with pytest.warns(UserWarning) as record:
        AdaHOPConverter.Config().build().convert(config)
    assert len(record) == 1
    message = str(record[0].message)
    assert "OwnLinear, a subclass" in message and "layers.0.feed_forward.w2 (300->256" in message
    kinds = {fqn: type(cfg) for fqn, cfg, _, _ in config.traverse(Linear.Config)}
    assert kinds["layers.0.feed_forward.w1"] is OwnLinear and kinds["layers.0.feed_forward.w2"] is Linear.Config
    assert kinds["layers.0.feed_forward.w3"] is AdaHOPTitanLinear.Config


def debug_config(n_layers, recipe=None):
    """The debug model cut to ``n_layers`` blocks (CPU time), converted as ``model_registry`` does."""
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    return config if recipe is None else AdaHOPConverter.Config(recipe=str(recipe)).build().convert(config)


def test_debug_model_forward_matches_the_bf16_model(eager_attention):
    torch.manual_seed(0)
    plain = build(debug_config(2))
    converted = build(debug_config(2, "mxfp4"))
    converted.load_state_dict(plain.state_dict())  # same keys: a plain torchtitan checkpoint loads
    tokens = torch.randint(0, VOCAB, (1, 64))
    with torch.no_grad():
        ref, out = run(plain, tokens), run(converted, tokens)
    assert out.shape == (1, 64, VOCAB) and torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.2, rel  # MXFP4 in every block GEMM, not a no-op


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_calibrates_in_training_and_the_plan_travels_in_a_dcp_checkpoint(eager_attention, tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"name": "adahop_lv2", "calibration_steps": 2}))
    torch.manual_seed(0)
    model = build(debug_config(1, recipe))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (1, 65))
    for _ in range(3):  # 2 calibration steps, then one with the frozen plan
        logits = run(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    plan = model_plan(model)
    assert len(plan) == 5  # wqkv, wo, w1, w2, w3 of the block all froze

    wrapper = ModelWrapper(model)  # what torchtitan's CheckpointManager saves
    dcp.save(wrapper.state_dict(), checkpoint_id=str(tmp_path / "step-3"))

    resumed = build(debug_config(1, recipe))
    assert len(model_plan(resumed)) == 0
    target = ModelWrapper(resumed)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "step-3"))
    target.load_state_dict(state)  # as CheckpointManager.dcp_load does
    assert dict(model_plan(resumed)) == dict(plan)
    for name, layer in resumed.named_modules():
        if isinstance(layer, AdaHOPLinear):
            assert layer.votes.state_dict() == model.get_submodule(name).votes.state_dict()


def test_a_saved_plan_builds_every_layer_frozen_and_a_missing_entry_is_an_error(tmp_path):
    """``plan=`` skips calibration, as ``convert_model(plan=...)`` does; the plan of an
    activation-checkpointed model names the layers without the wrapper."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    from adahop.policy import LayerPlan

    calibrated = build(debug_config(2, "adahop_lv2"))
    FullAC(FullAC.Config()).apply(calibrated)
    plans = [LayerPlan("mxfp4", "iht", "bf16"), LayerPlan("oe_left", "oe_right", "iht"), LayerPlan.uniform("bf16")]
    for i, layer in enumerate(m for m in calibrated.modules() if isinstance(m, AdaHOPLinear)):
        layer.set_plan(plans[i % 3])
    plan = model_plan(calibrated)
    assert len(plan) == 10 and not any("_checkpoint_wrapped_module" in name for name in plan)
    plan.save(tmp_path / "plan.json")

    config = AdaHOPConverter.Config(recipe="adahop_lv2", plan=str(tmp_path / "plan.json"))
    built = build(config.build().convert(debug_config(2)))
    assert dict(model_plan(built)) == dict(plan)  # every layer frozen: none calibrates

    (tmp_path / "partial.json").write_text(plan.to_json().replace("layers.1.feed_forward.w2", "elsewhere"))
    config = AdaHOPConverter.Config(recipe="adahop_lv2", plan=str(tmp_path / "partial.json"))
    with pytest.raises(ValueError, match=r"has no entry for layers \['layers.1.feed_forward.w2'\]"):
        config.build().convert(debug_config(2))


def test_compile_enabled_leaves_dynamo_a_graph_per_block(monkeypatch):
    """Blocks whose layers froze other plans are other graphs (tests/test_calibration_stacks.py
    compiles a calibrating block fullgraph)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    AdaHOPConverter.Config(recipe="adahop_lv2").build().convert(debug_config(3))
    assert torch._dynamo.config.recompile_limit == 2
    AdaHOPConverter.Config(recipe="adahop_lv2", model_compile_enabled=True).build().convert(debug_config(3))
    assert torch._dynamo.config.recompile_limit == 4  # 3 blocks and the calibrating graph


def test_ready_made_config_loads_through_torchtitans_cli():
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        [
            "--module",
            "adahop.integrations.torchtitan",
            "--config",
            "llama3_debugmodel_adahop",
            "--training.steps",
            "300",
        ]
    )
    assert config.training.steps == 300
    kinds = [type(c) for _, c, _, _ in config.model_spec.model.traverse(Linear.Config)]
    assert kinds.count(AdaHOPTitanLinear.Config) == 6 * 5 and kinds.count(Linear.Config) == 1  # the LM head


def test_scoped_bf16_gemms_and_bf16_layers_reach_the_built_layers_and_a_typo_is_an_error(tmp_path):
    """``ROLE@PATTERN`` and ``bf16_layers`` act on torchtitan's module names, as in ``convert_model``."""
    recipe = tmp_path / "scoped.toml"
    recipe.write_text('name = "mxfp4"\nbf16_gemms = ["forward@*.attention.*"]\nbf16_layers = ["layers.0.*"]\n')
    model = build(debug_config(2, recipe))
    kept = {name: m.bf16_gemms for name, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
    assert kept["layers.0.feed_forward.w2"] == ("forward", "dgrad", "wgrad")
    assert kept["layers.1.attention.qkv_linear.wqkv"] == ("forward",)
    assert kept["layers.1.feed_forward.w2"] == ()
    typo = tmp_path / "typo.toml"
    typo.write_text('name = "mxfp4"\nbf16_gemms = ["dgrad@*.nosuchlayer"]\n')
    with pytest.raises(ValueError, match="'dgrad@\\*.nosuchlayer' matches no converted layer"):
        debug_config(2, typo)


def test_without_triton_the_import_says_what_to_install(tmp_path):
    """torchtitan 0.3's model code imports Triton; the ``torchtitan`` extra installs it, and without it
    the import error says so in one line."""
    import os
    import subprocess
    import sys

    block = (
        "import sys, importlib.abc\n"
        "class NoTriton(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import adahop.integrations.torchtitan\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", block],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        'ImportError: torchtitan 0.3 needs Triton to import (its MoE kernels): pip install "adahop[torchtitan]" installs it'
    )
