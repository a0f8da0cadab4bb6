"""adahop.integrations.torchtitan against torchtitan 0.2.x (the GPU image's torch 2.11 takes 0.2.2).

CI installs torchtitan 0.3, so these skip there; run them with a 0.2.2 on the path. 0.2.2's
debug model uses SDPA, which trains on CPU.
"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")
titan = pytest.importorskip("adahop.integrations.torchtitan")

from adahop import AdaHOPLinear, model_plan  # noqa: E402

pytestmark = pytest.mark.skipif(titan.API != "0.2", reason="torchtitan 0.2 API tests")

if titan.API == "0.2":
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.protocols.model_converter import build_model_converters

VOCAB = 2048


def job_config(recipe_path):
    return ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "adahop.integrations.torchtitan",
            "--job.dump_folder",
            str(recipe_path.parent),
            "--model.converters",
            "adahop",
            "--adahop.recipe",
            str(recipe_path),
        ]
    )


def build(job):
    """What torchtitan 0.2's trainer does: build on meta, convert, to_empty, init_weights."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(llama3_args["debugmodel"], n_layers=1))
    converters = build_model_converters(job, parallel_dims=None)
    converters.convert(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, converters


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_converts_trains_and_checkpoints_the_plan(tmp_path, caplog):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"name": "adahop_lv2", "calibration_steps": 2}))
    caplog.set_level("INFO")  # torchtitan logs through the root logger
    job = job_config(recipe)
    torch.manual_seed(0)
    model, converters = build(job)
    layers = {n for n, m in model.named_modules() if isinstance(m, AdaHOPLinear)}
    assert layers == {
        f"layers.0.{n}"
        for n in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert type(model.output) is torch.nn.Linear

    wrapper = ModelWrapper(model)  # built before training, as 0.2's CheckpointManager is: it caches
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (1, 65))
    losses = []
    for _ in range(4):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        converters.post_optimizer_hook([model])  # registered as the optimizer's step post-hook
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    plan = model_plan(model)
    assert len(plan) == len(layers)
    assert "adahop: every layer has frozen its plan (by optimizer step 3 of this run)" in caplog.text
    assert dict(type(plan).load(tmp_path / titan.PLAN_FILE)) == dict(plan)  # the converter saved it
    dcp.save(wrapper.state_dict(), checkpoint_id=str(tmp_path / "step-4"))

    resumed, resumed_converters = build(job)
    target = ModelWrapper(resumed)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "step-4"))
    target.load_state_dict(state)
    assert dict(model_plan(resumed)) == dict(plan)
    caplog.clear()
    resumed_converters.post_optimizer_hook([resumed])  # after the first step of the resumed run
    assert f"adahop: {len(layers)} of {len(layers)} layers resumed with the frozen plans" in caplog.text
