"""Calibration on 1, 2 and 4 ranks (FSDP2 over gloo) freezes the same plan for the same global batch.

Each step's global batch is split by tokens over the ranks. The outliers are planted in one share
only: the last quarter of the tokens carries an outlier channel of X, the first four tokens an
outlier row of dY. A rank voting its own share would see no pattern on most ranks; merging the
statistics before the vote (``policy.calibration``) sees the whole batch, as one process does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from adahop import convert_model

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.usefixtures("one_thread"),
]
TOKENS = 128  # per global batch
STEPS = 3  # two of calibration, then one frozen step
RECIPE = {"name": "adahop_lv2", "calibration_steps": 2}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return convert_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), RECIPE)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(TOKENS, 64, generator=gen)
    x[3 * TOKENS // 4 :, 5] *= 40.0  # an outlier channel in the last quarter of the tokens only
    target = torch.zeros(TOKENS, 64)
    target[:4] = 50.0  # four tokens with a large error: outlier rows of dY in the first share only
    return x, target


def train(model: nn.Module, rank: int, world: int) -> list[dict]:
    """``STEPS`` steps on this rank's share; each layer's votes after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # its pre-step hook ends each step
    share = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    votes = []
    for step in range(STEPS):
        x, target = global_batch(step)
        (model(x[share]) - target[share]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        votes.append({name: model.get_submodule(name).votes.state_dict() for name in ("0", "2")})
    return votes


def run_rank(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    torch.save(train(model, rank, world), f"{out}.{rank}")
    dist.barrier()  # tear down together (see tests/test_fsdp.py)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_count_votes_as_one_process_on_the_global_batch(tmp_path, world):
    reference = train(make_model(), rank=0, world=1)
    assert reference[-1]["0"]["counts"]["x"] == {"col": 2}  # the planted patterns decide the votes
    assert reference[-1]["2"]["counts"]["g"] == {"row": 2}

    out = str(tmp_path / "votes")
    mp.start_processes(run_rank, args=(world, f"file://{tmp_path}/rendezvous", out), nprocs=world, start_method="spawn")
    for rank in range(world):
        assert torch.load(f"{out}.{rank}") == reference, rank
