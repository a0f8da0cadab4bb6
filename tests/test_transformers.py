"""adahop on a Hugging Face transformers Llama (small random-init config, CPU)."""

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from adahop import AdaHOPLinear, convert_model, model_plan  # noqa: E402
from adahop.integrations.transformers import PLAN_FILE, from_pretrained, save_pretrained  # noqa: E402

RECIPE = {"name": "adahop_lv2", "calibration_steps": 2}


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def trained():
    """A converted tiny Llama after 5 steps on one fixed batch (2 of them calibration)."""
    torch.manual_seed(0)
    model = convert_model(tiny_llama(), RECIPE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 32))
    losses = []
    for _ in range(5):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, tokens, losses


def test_converted_llama_trains_with_falling_loss(trained):
    model, _, losses = trained
    assert type(model.lm_head) is torch.nn.Linear
    assert sum(isinstance(m, AdaHOPLinear) for m in model.modules()) == 2 * 7
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5, losses
    plan = model_plan(model)
    assert len(plan) == 14 and not all(p.all_bf16 for p in plan.values())


def test_save_pretrained_keeps_plain_keys_and_the_plan_travels(trained, tmp_path):
    model, tokens, _ = trained
    save_pretrained(model, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(tiny_llama().state_dict())
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, AdaHOPLinear) for m in plain.modules())
    assert torch.equal(plain.model.layers[1].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)

    restored = from_pretrained(transformers.LlamaForCausalLM, tmp_path, RECIPE)
    assert dict(model_plan(restored)) == dict(model_plan(model))
    model.eval(), restored.eval()
    with torch.no_grad():
        assert torch.equal(restored(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_plain_save_pretrained_of_a_converted_model_loads_too(tmp_path):
    model = convert_model(tiny_llama(), RECIPE)
    model.save_pretrained(tmp_path)  # _extra_state is a tensor: safetensors takes it
    assert any(k.endswith("._extra_state") for k in load_file(tmp_path / "model.safetensors"))
    transformers.LlamaForCausalLM.from_pretrained(tmp_path)  # reported as unexpected keys, not an error
    save_pretrained(model, tmp_path)  # still calibrating: no plan file
    assert not (tmp_path / PLAN_FILE).exists()


def test_an_unconverted_model_saves_no_plan_and_loads_back_converted(tmp_path):
    save_pretrained(tiny_llama(), tmp_path)
    assert not (tmp_path / PLAN_FILE).exists()  # an empty plan would make from_pretrained fail
    restored = from_pretrained(transformers.LlamaForCausalLM, tmp_path, RECIPE)
    assert all(layer.calibrating for layer in restored.modules() if isinstance(layer, AdaHOPLinear))


def test_a_plan_saved_under_another_recipe_is_refused_on_load(trained, tmp_path):
    model, _, _ = trained  # adahop_lv2
    save_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="is not what recipe 'mxfp4' runs"):
        from_pretrained(transformers.LlamaForCausalLM, tmp_path, "mxfp4")
