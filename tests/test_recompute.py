"""Recomputed steps: the steps that vote patterns (calibration, telemetry) run uncompiled, so the
trainer checkpoints each block's activations on them (``training.recompute_pattern_steps``). A
recompute must train exactly as the step without it, keep fewer activations, and vote nothing
more (votes are cast in backward: tests/test_calibration_stacks.py covers other checkpointers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend

from adahop.models import build_model
from adahop import end_calibration_step
from adahop.nn import AdaHOPLinear, convert_model
from adahop.recipes import get_recipe
from adahop.train import Trainer, load_config, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def _saved_bytes_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, float, list]:
    """Bytes the autograd graph keeps for backward (outside checkpointed blocks), the loss, grads."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same stochastic-rounding seeds in both passes
    # The math attention kernel: CUDA's fused attention backward need not repeat itself bit for bit.
    with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return saved, loss.item(), [p.grad.clone() for p in model.parameters()]


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("phase", ["calibrating", "frozen"])
def test_recomputed_blocks_give_the_same_gradients_and_keep_far_fewer_activations(phase, device):
    """Calibrating: BF16 GEMMs and votes. Frozen: MXFP4 with stochastic rounding, whose seeds the
    recompute must draw again exactly as the forward drew them (on CUDA: on the device)."""
    torch.manual_seed(0)
    recipe = dataclasses.replace(get_recipe("adahop_lv2"), calibration_steps=1 if phase == "frozen" else 30)
    model = convert_model(build_model("tiny", vocab_size=256, n_layers=3, dim=64), recipe=recipe).to(device)
    model.train()
    tokens = torch.randint(0, 256, (2, 65), device=device)
    layers = [m for m in model.modules() if isinstance(m, AdaHOPLinear)]
    if phase == "frozen":
        _saved_bytes_and_grads(model, tokens)  # the one calibration step
        end_calibration_step(model)  # its boundary freezes the plans

    kept, loss, grads = _saved_bytes_and_grads(model, tokens)
    assert all(layer.calibrating == (phase == "calibrating") for layer in layers)
    model.recompute = True
    kept_recomputed, loss_recomputed, grads_recomputed = _saved_bytes_and_grads(model, tokens)

    assert loss_recomputed == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_recomputed, strict=True))
    assert kept_recomputed < kept / 3
    if phase == "calibrating":  # the two passes voted as one step: the recompute added nothing
        end_calibration_step(model)
        assert {layer.votes.count(role) for layer in layers for role in ("x", "w", "g")} == {1}


def test_trainer_recomputes_exactly_the_voting_steps_and_trains_the_same(small_overrides, tmp_path, monkeypatch):
    seen: list[tuple[int, bool]] = []
    micro_step = Trainer._micro_step

    def spy(self, *args, **kwargs):
        seen.append((self.step + 1, self.model.recompute))
        return micro_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_micro_step", spy)
    extra = {
        "recipe": "adahop_lv2",
        "training__steps": 8,
        "training__pattern_telemetry_every": 3,
        "training__compile": True,
        "training__compile_backend": "aot_eager",
    }
    runs = {}
    for recompute in (True, False):
        seen.clear()
        run = tmp_path / str(recompute)
        cfg = load_config(None, small_overrides(run, training__recompute_pattern_steps=recompute, **extra))
        trainer = Trainer(cfg, progress=False)
        trainer.train()
        states = {name: layer.get_extra_state().clone() for name, layer in trainer.named_layers.items()}
        runs[recompute] = (list(seen), read_metrics(run), states, (run / "plan.json").read_text())

    # Calibration votes on steps 1-2 and freezes right before step 2's update; telemetry samples steps 3 and 6.
    assert [step for step, recomputed in runs[True][0] if recomputed] == [1, 2, 3, 6]
    assert not any(recomputed for _, recomputed in runs[False][0])
    seen_on, metrics_on, states_on, plan_on = runs[True]
    _, metrics_off, states_off, plan_off = runs[False]
    losses = [(r["kind"], r["step"], r["loss"]) for r in metrics_on if r["kind"] in ("train", "val")]
    assert losses == [(r["kind"], r["step"], r["loss"]) for r in metrics_off if r["kind"] in ("train", "val")]
    assert plan_on == plan_off
    assert all(torch.equal(states_on[name], states_off[name]) for name in states_on)  # the same votes


def test_a_kept_graph_recomputes_again_on_a_second_backward():
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=256, n_layers=2, dim=64).train()
    model.recompute = True
    tokens = torch.randint(0, 256, (2, 17))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), first, strict=True))


def test_the_recompute_does_not_call_the_block_module_again():
    """The checkpoint sits inside each block, so module hooks (FSDP2's all-gather and input cast;
    torch <= 2.12 does not cast again in a recompute) run once per forward, not again in backward."""
    model = build_model("tiny", vocab_size=256, n_layers=2, dim=64).train()
    model.recompute = True
    calls = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    tokens = torch.randint(0, 256, (2, 17))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert calls == list(model.layers)


def test_recompute_runs_inside_fsdp2_units_with_the_cast_inputs(tmp_path):
    """Checkpointing inside each block keeps FSDP2's hooks outside the checkpoint: with BF16
    parameters (the trainer's CUDA policy) the recompute sees the inputs the unit cast."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = convert_model(build_model("tiny", vocab_size=256, n_layers=2, dim=64), recipe="adahop_lv2")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.train()
        tokens = torch.randint(0, 256, (2, 33))
        losses = []
        for recompute in (False, True):
            model.recompute = recompute
            model.zero_grad()
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == losses[1]
        end_calibration_step(model)  # both passes are one step's share: one vote each
        assert all(layer.votes.count("g") == 1 for layer in model.modules() if isinstance(layer, AdaHOPLinear))
    finally:
        dist.destroy_process_group()
