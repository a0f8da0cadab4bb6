"""FSDP2's mixed precision and ``training.distributed`` (one process through the multi-GPU
path), on the CPU over gloo: the policy the trainer asks for on CUDA (BF16 parameters, FP32
gradient reduction) is the one FSDP2 holds and applies, and ``adahop train`` under
``torchrun --nproc-per-node=1`` with ``--training.distributed=true`` joins a process group,
shards and writes sharded checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rendezvous import HostedStore
from torch.distributed.fsdp import fully_shard

from adahop import convert_model
from adahop.models import build_model
from adahop.train.cli import main
from adahop.train.distributed import describe_sharding, mixed_precision_policy, process_group

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


@pytest.fixture
def torchrun_one(monkeypatch):
    """torchrun's variables for one process (``--nproc-per-node=1``)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    store = HostedStore()
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    yield
    del store


def test_policy_is_bf16_params_fp32_reduce_on_cuda_and_fp32_on_cpu():
    cuda = mixed_precision_policy(torch.device("cuda", 0))
    assert (cuda.param_dtype, cuda.reduce_dtype) == (torch.bfloat16, torch.float32)
    cpu = mixed_precision_policy(torch.device("cpu"))
    assert (cpu.param_dtype, cpu.reduce_dtype, cpu.output_dtype) == (None, None, None)


def test_one_process_stays_single_unless_asked(torchrun_one):
    with process_group("cpu") as env:
        assert not env.distributed and not dist.is_initialized()
    with process_group("cpu", always=True) as env:
        assert env.distributed and env.world_size == 1 and dist.get_backend() == "gloo"
    assert not dist.is_initialized()


def test_training_distributed_outside_torchrun_says_so(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        with process_group("cpu", always=True):
            pass


def test_fsdp2_holds_and_applies_the_cuda_policy(torchrun_one):
    """The CUDA policy, applied on the CPU: FSDP2 reports it, a block computes with BF16
    weights, and the sharded parameters and their gradients stay FP32."""
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=512, n_layers=2, dim=64, n_heads=2, n_kv_heads=1, max_seq_len=32)
    convert_model(model, "bf16")
    policy = mixed_precision_policy(torch.device("cuda"))
    seen = []
    model.layers[0].attention.wq.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    with process_group("cpu", always=True):
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        described = describe_sharding(model)
        tokens = torch.randint(0, 512, (2, 17))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        dtypes = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
    assert (
        described == "backend gloo, 1 ranks, FSDP2 MixedPrecisionPolicy: 3 units with params bfloat16, reduce float32"
    )
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert dtypes == {torch.float32}


def test_adahop_train_on_one_process_through_fsdp2(torchrun_one, small_overrides, tmp_path, caplog):
    out = tmp_path / "run"
    argv = [f"--{k}={v}" for k, v in small_overrides(out, training__steps=4)] + ["--training.distributed=true"]
    with caplog.at_level("INFO", logger="adahop"):
        assert main(argv) == 0
    assert (
        "distributed: backend gloo, 1 ranks, FSDP2 MixedPrecisionPolicy: 3 units with params as stored" in caplog.text
    )
    # One rank gathers nothing (FSDP2 copies its shard), so the low-precision all-gather stays off.
    assert "gathered as their quantized GEMM operands" not in caplog.text
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step_0000002", "step_0000004"] and all(p.is_dir() for p in checkpoints)
    assert "distributed = true" in (out / "config.toml").read_text()
