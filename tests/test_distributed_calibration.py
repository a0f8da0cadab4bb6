"""Calibration on 1, 2 and 4 ranks (FSDP2 over gloo) freezes the same plan for the same global batch,
and pattern telemetry after the freeze votes as one process does.

Each step's global batch is split by tokens over the ranks. The outliers are planted in one share
only: the last quarter of the tokens carries an outlier channel of X, the first four tokens an
outlier row of dY. A rank voting its own share would see no pattern on most ranks; merging the
statistics before the vote (``policy.calibration``) sees the whole batch, as one process does.
Each linear is an FSDP2 unit of its own, so telemetry's hooks, which run after FSDP2 resharded
the layer, see W as this rank's rows: W's first rows carry outliers (rank 0's rows only), and
every rank must still vote the whole W's pattern.
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
STEPS = 3  # two of calibration, then one frozen step, whose patterns telemetry samples
RECIPE = {"name": "adahop_lv2", "calibration_steps": 2}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    with torch.no_grad():
        model[0].weight[:4] *= 40.0  # outlier rows of W, all on rank 0 (its first 128 / ranks rows)
    return convert_model(model, RECIPE)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(TOKENS, 64, generator=gen)
    x[3 * TOKENS // 4 :, 5] *= 40.0  # an outlier channel in the last quarter of the tokens only
    target = torch.zeros(TOKENS, 64)
    target[:4] = 50.0  # four tokens with a large error: outlier rows of dY in the first share only
    return x, target


def train(model: nn.Module, rank: int, world: int) -> dict:
    """``STEPS`` steps on this rank's share: each layer's votes after every step, and the patterns
    telemetry sampled on the last step (``votes``, ``sampled``)."""
    from adahop.nn import adahop_layers
    from adahop.train.telemetry import calibrated_layers, sample_patterns

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # its pre-step hook ends each step
    share = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    votes = []
    for step in range(STEPS):
        x, target = global_batch(step)
        sampled = calibrated_layers(adahop_layers(model)) if step == STEPS - 1 else {}
        with sample_patterns(sampled) as sampled_votes:  # as the trainer samples a step
            (model(x[share]) - target[share]).square().mean().backward()
            optimizer.step()
        optimizer.zero_grad()
        votes.append({name: model.get_submodule(name).votes.state_dict() for name in ("0", "2")})
    return {"votes": votes, "sampled": {name: v.state_dict() for name, v in sampled_votes.items()}}


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


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(make_model(), rank=0, world=1)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory) -> list[dict]:
    """What each of 2 or 4 ranks voted."""
    world, tmp = request.param, tmp_path_factory.mktemp(f"world{request.param}")
    out = str(tmp / "votes")
    mp.start_processes(run_rank, args=(world, f"file://{tmp}/rendezvous", out), nprocs=world, start_method="spawn")
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


def test_every_rank_count_votes_as_one_process_on_the_global_batch(reference, ranks):
    assert reference["votes"][-1]["0"]["counts"]["x"] == {"col": 2}  # the planted patterns decide the votes
    assert reference["votes"][-1]["2"]["counts"]["g"] == {"row": 2}
    for rank, result in enumerate(ranks):
        assert result["votes"] == reference["votes"], rank


def test_telemetry_with_a_unit_per_linear_votes_the_whole_weight_as_one_process(reference, ranks):
    """The sampled step's votes, W's among them, are one process's on every rank."""
    sampled = reference["sampled"]
    assert sampled.keys() == {"0", "2"}
    assert sampled["0"]["counts"] == {"x": {"col": 1}, "w": {"row": 1}, "g": {"row": 1}}  # W's outlier rows seen
    for rank, result in enumerate(ranks):
        assert result["sampled"] == sampled, rank
