"""AdamW's state made before the first step (``train.optim.allocate_state``).

On a GPU, state made by the first step lands in the blocks that step's eager forward and backward
just freed, and keeps those segments reserved beside the CUDA graphs' private pool for the whole
run (issue 30). Made earlier it must be exactly the state torch's first step would have made: same
tensors (dtype, device, strides), so training goes on bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from adahop.train import Trainer
from adahop.train import trainer as trainer_module
from adahop.train.config import load_config
from adahop.train.optim import allocate_state


def adamw(fused: bool, amsgrad: bool) -> torch.optim.AdamW:
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(8, 4)),
        torch.nn.Parameter(torch.randn(8, 4).t()),  # strided: the moments keep its layout
        torch.nn.Parameter(torch.randn(4)),
    ]
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused, amsgrad=amsgrad)


def layout(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [
        {name: (t.dtype, t.device, t.shape, t.stride()) for name, t in optimizer.state[p].items()}
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def step(optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g).as_strided(p.shape, p.stride())
    optimizer.step()


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_state_made_before_the_first_step_is_the_state_that_step_makes(fused, amsgrad):
    lazy, early = adamw(fused, amsgrad), adamw(fused, amsgrad)
    allocate_state(early)
    made = layout(early)
    assert all(not t.any() for state in early.state.values() for t in state.values())  # step 0, zero moments
    for seed in range(3):
        step(lazy, seed)
        step(early, seed)
        if seed == 0:
            assert made == layout(lazy)  # what torch's first step makes, tensor for tensor
    for a, b in zip(lazy.param_groups[0]["params"], early.param_groups[0]["params"]):
        assert torch.equal(a, b)
        assert all(torch.equal(lazy.state[a][name], early.state[b][name]) for name in lazy.state[a])


def test_state_already_there_is_kept():
    optimizer = adamw(fused=False, amsgrad=False)
    step(optimizer, 0)
    before = {id(t) for state in optimizer.state.values() for t in state.values()}
    allocate_state(optimizer)  # a resumed run's loaded state is not replaced
    assert before == {id(t) for state in optimizer.state.values() for t in state.values()}


def trained(small_overrides, out, steps: int) -> tuple[Trainer, bool]:
    trainer = Trainer(load_config(None, small_overrides(out, recipe="adahop_lv2")), progress=False)
    made_before = len(trainer.optimizer.state) == sum(len(g["params"]) for g in trainer.optimizer.param_groups)
    for _ in range(steps):
        trainer.train_step()
    return trainer, made_before


def test_the_trainer_makes_the_state_before_calibrating_and_trains_bit_for_bit_as_before(
    small_overrides, tmp_path, monkeypatch
):
    early, made_before = trained(small_overrides, tmp_path / "early", steps=3)  # 2 calibrating, 1 frozen
    assert made_before
    monkeypatch.setattr(trainer_module, "allocate_state", lambda optimizer: None)  # as before: the first step makes it
    lazy, _ = trained(small_overrides, tmp_path / "lazy", steps=3)
    assert early.phase == "frozen"
    for (name, a), b in zip(early.model.named_parameters(), lazy.model.parameters()):
        assert torch.equal(a, b), name
        for key, value in lazy.optimizer.state[b].items():
            assert torch.equal(early.optimizer.state[a][key], value), f"{name} {key}"
