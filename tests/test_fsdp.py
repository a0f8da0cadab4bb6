"""AdaHOPLinear under PyTorch FSDP2 (``fully_shard``), two CPU ranks over gloo.

Sharding changes nothing in the numerics: a rank quantizes its own tokens, and with MX and
Hadamard blocks along tokens aligned to each rank's slice, the reduced gradients equal the
single-process ones on the whole batch. Calibration on several ranks: tests/test_distributed_calibration.py.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from adahop import convert_model
from adahop.nn import model_plan

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
WORLD = 2
TOKENS_PER_RANK = 64


def make_model(recipe: dict) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return convert_model(model, recipe)


def batch(step: int) -> torch.Tensor:
    """The global batch of a step; rank r takes rows [64 r, 64 (r + 1)). Rank 1's half carries
    a planted outlier channel, rank 0's does not, so their local patterns disagree."""
    x = torch.randn(WORLD * TOKENS_PER_RANK, 64, generator=torch.Generator().manual_seed(step))
    x[TOKENS_PER_RANK:, 5] *= 40.0
    return x


def run_rank(rank: int, init: str, recipe: dict, steps: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = make_model(recipe)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    for step in range(steps):
        local = batch(step)[rank * TOKENS_PER_RANK : (rank + 1) * TOKENS_PER_RANK]
        model.zero_grad()
        model(local).square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    plans = {n: (None if p is None else p.to_dict()) for n, p in model_plan(model).items()}
    torch.save({"grads": grads, "plans": plans, "keys": sorted(model.state_dict())}, f"{out}.{rank}")
    # Tear down together: a rank that exits while its peer's gloo threads still talk to it made
    # that peer abort ("terminate called without an active exception") about once in 40 runs.
    dist.barrier()
    dist.destroy_process_group()


def run_fsdp(tmp_path, recipe: dict, steps: int) -> list[dict]:
    init = f"file://{tmp_path}/rendezvous"
    out = str(tmp_path / "result")
    mp.start_processes(run_rank, args=(init, recipe, steps, out), nprocs=WORLD, start_method="spawn")
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


def test_fsdp2_gradients_equal_single_process(tmp_path):
    recipe = {"name": "mxfp4_hadamard", "grad_rounding": "nearest"}
    ranks = run_fsdp(tmp_path, recipe, steps=1)
    ref = make_model(recipe)
    ref(batch(0)).square().mean().backward()
    for name, p in ref.named_parameters():
        got = ranks[0]["grads"][name]
        assert ((got - p.grad).norm() / p.grad.norm()).item() < 1e-6, name
    assert "0._extra_state" in ranks[0]["keys"]
