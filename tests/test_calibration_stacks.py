"""Calibration inside the stacks users run: every activation checkpointing flavour, Hugging Face
gradient checkpointing and ``torch.compile(fullgraph=True)`` from step 0.

Each run calibrates for two steps (the optimizer's pre-step hook ends a step), freezes, and trains a
frozen step. Against the same run without checkpointing: one vote per tensor per step (a recompute
counts nothing twice), the same plan, the same losses through the freeze (the freeze falls between
two steps, never inside a forward that backward replays).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch._dynamo.testing
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from adahop.models import build_model
from adahop.nn import AdaHOPLinear, convert_model
from adahop.recipes import get_recipe

pytestmark = pytest.mark.usefixtures("one_thread")
RECIPE = dataclasses.replace(get_recipe("adahop_lv2"), calibration_steps=2)
STEPS = 3


def save_matmuls(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """A selective policy as torchtitan's: keep the matmuls' outputs, recompute the rest."""
    keep = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: torch.nn.Module, flavour: str) -> None:
    """Wrap each transformer block as ``flavour`` does (torchtitan's ``apply`` does the same)."""
    if flavour.startswith("torchtitan"):
        ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
        policy = ac.FullAC if flavour == "torchtitan_full" else ac.SelectiveAC
        policy(policy.Config()).apply(model)
        return
    wrap = {
        "full_non_reentrant": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        "full_reentrant": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        "selective": functools.partial(
            checkpoint_wrapper, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        ),
    }[flavour]
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, wrap(block))


def train(model: torch.nn.Module, forward) -> tuple[list[float], list[list[dict]], list]:
    """``STEPS`` steps of SGD; the losses, each layer's votes after every step, the final plans."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = [m for m in model.modules() if isinstance(m, AdaHOPLinear)]
    losses, votes = [], []
    for step in range(STEPS):
        loss = forward(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        votes.append([layer.votes.state_dict() for layer in layers])
    assert not any(layer.calibrating for layer in layers)
    return losses, votes, [layer.plan for layer in layers]


def tiny_llama(n_layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return convert_model(build_model("tiny", vocab_size=256, n_layers=n_layers, dim=64), RECIPE).train()


def llama_step(model: torch.nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(step))
    return model(tokens[:, :-1], tokens[:, 1:])[1]


@pytest.fixture(scope="module")
def unwrapped():
    return train(tiny_llama(), llama_step)


@pytest.mark.parametrize(
    "flavour", ["full_non_reentrant", "full_reentrant", "selective", "torchtitan_full", "torchtitan_selective"]
)
def test_activation_checkpointing_votes_once_per_step_and_freezes_between_steps(unwrapped, flavour):
    model = tiny_llama()
    checkpoint_blocks(model, flavour)
    losses, votes, plans = train(model, llama_step)
    assert votes == unwrapped[1]
    assert all(sum(v["counts"][role].values()) == 1 for v in votes[0] for role in "xwg")  # one vote, not two
    assert plans == unwrapped[2]
    assert losses == unwrapped[0]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hugging_face_gradient_checkpointing(use_reentrant):
    transformers = pytest.importorskip("transformers")

    def build(checkpointing: bool):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        )
        model = convert_model(transformers.LlamaForCausalLM(config), RECIPE).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        return model

    def step(model, step):
        ids = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(step))
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    assert train(build(True), step) == train(build(False), step)


def test_a_block_compiled_fullgraph_from_step_0_calibrates_and_recompiles_once_at_the_freeze():
    """As torchtitan compiles: each transformer block, ``fullgraph=True``, Inductor, before the first step."""
    eager = train(tiny_llama(n_layers=1), llama_step)
    model = tiny_llama(n_layers=1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    model.layers[0].compile(backend=counter, fullgraph=True)
    frames = []

    def counted_step(model, step):
        loss = llama_step(model, step)
        frames.append(counter.frame_count)
        return loss

    losses, votes, plans = train(model, counted_step)
    assert frames == [1, 1, 2]  # one graph while calibrating, one more after the freeze
    assert plans == eager[2] and votes == eager[1]
    assert losses[:2] == pytest.approx(eager[0][:2], rel=1e-6)
