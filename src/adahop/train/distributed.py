"""Data-parallel training on several processes with PyTorch's own stack: ``torch.distributed``
and FSDP2's ``fully_shard``.

``torchrun --nproc-per-node=N -m adahop train ...`` starts N processes and sets ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` for each; :func:`process_group` joins them (gloo on CPU, nccl
on CUDA with one GPU per local rank) and leaves the group on the way out, error or not. Without
those variables (or with ``WORLD_SIZE=1``) nothing here runs and the trainer is single-process,
unless ``training.distributed`` asks for the group anyway: then one process under
``torchrun --nproc-per-node=1`` trains through the multi-GPU path (nccl, FSDP2, sharded
checkpoints), e.g. to try that path on one GPU.

When one rank stops on an error its peers must not wait for it in a collective forever. The
rank that fails first claims the failure in the process group's store and reports it; leaving
the group then breaks the collectives its peers wait in (gloo notices at once), and they stop
quietly (:func:`claim_failure` returns False for them), so a failed run prints one message.
An nccl collective does not notice a peer leaving; there torchrun, seeing a rank exit with an
error, stops the others.

A rank that stalls (stopped, stuck in I/O, a wedged GPU) leaves no error to notice: its peers
wait in a collective until ``training.timeout`` (:func:`use_training_timeout`; joining the group
and the first step get at least :data:`INIT_TIMEOUT_S`, as torchtitan's init and train
timeouts). On gloo the waiting ranks then raise: each marks itself as answering in the store,
and the one that reports names the ranks that did not (:func:`silent_ranks`). On nccl torch's
watchdog ends the process and torchrun reports. Under torchrun a worker also dies with its
launcher (:func:`die_with_launcher`), so a SIGKILLed torchrun leaves no orphans training on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..nn import fsdp
from .builders import resolve_device

_FAILED_KEY = "adahop/failures"  # counts the ranks that stopped on an error
_ANSWERED_KEY = "adahop/answered/{rank}"  # set by a rank whose collective timed out: it was not the one stalled
INIT_TIMEOUT_S = 600.0  # the least timeout while joining and for the first step (tokenizer cache, compile)
_PR_SET_PDEATHSIG = 1  # prctl(2)


class PeerFailedError(RuntimeError):
    """This rank stopped because another rank did; that rank reports why."""


@dataclass(frozen=True)
class ParallelEnv:
    """Where this process sits in the run: its rank, the number of ranks and its device."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # in a process group (always with several ranks; on one with training.distributed)
    timeout: float = 0.0  # seconds a collective waits for a peer (training.timeout), once training runs

    @property
    def distributed(self) -> bool:
        """In a process group: collectives, FSDP2 and sharded checkpoints."""
        return self.world_size > 1 or self.joined

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes the run's records (metrics, plan, config) and shows the progress bar."""
        return self.rank == 0


def launch_rank() -> int:
    """This process's rank as set by torchrun (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def process_group(device: str = "auto", always: bool = False, timeout: float = INIT_TIMEOUT_S) -> Iterator[ParallelEnv]:
    """The run's :class:`ParallelEnv` for ``training.device``; under torchrun with
    ``WORLD_SIZE > 1`` (or any ``WORLD_SIZE`` when ``always``) the process group is joined for
    the block and destroyed after it. ``timeout`` (seconds): see :func:`use_training_timeout`."""
    die_with_launcher()  # under torchrun, one process or several
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = resolve_device(device)
    if world_size == 1 and not always:
        yield ParallelEnv(resolved)
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"training.distributed needs a torchrun launch ({', '.join(missing)} not set): "
            "torchrun --standalone --nproc-per-node=N -m adahop train ..."
        )
    rank, local_rank = launch_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    init_timeout = timedelta(seconds=max(timeout, INIT_TIMEOUT_S))
    if resolved.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "launch at most one process per GPU (torchrun --nproc-per-node)"
            )
        resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)
        dist.init_process_group("nccl", device_id=resolved, timeout=init_timeout)
    else:
        dist.init_process_group("gloo", timeout=init_timeout)
    try:
        yield ParallelEnv(resolved, rank, world_size, local_rank, joined=True, timeout=timeout)
    finally:
        dist.destroy_process_group()


def die_with_launcher() -> None:
    """Under torchrun, have the kernel SIGKILL this worker when its launcher dies (Linux
    ``PR_SET_PDEATHSIG``): a SIGKILLed torchrun must not leave workers that train on unseen."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(128 + signal.SIGKILL)


def use_training_timeout(env: ParallelEnv) -> None:
    """From here on a collective waits ``env.timeout`` seconds for a peer, then fails (gloo) or
    ends the process (nccl's watchdog). Called after the first step, whose collectives may wait
    for a peer's compile or calibration."""
    if env.distributed:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=env.timeout))


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective that waited ``training.timeout`` for a peer (gloo's words)."""
    return isinstance(error, RuntimeError) and "Timed out waiting" in str(error)


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective broken by a peer that exited (gloo's words)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


def mark_answering(env: ParallelEnv) -> None:
    """This rank's collective timed out: record that this rank, at least, did not stall."""
    with contextlib.suppress(RuntimeError, ValueError):
        dist.distributed_c10d._get_default_store().set(_ANSWERED_KEY.format(rank=env.rank), "1")


def silent_ranks(env: ParallelEnv) -> list[int]:
    """The ranks that did not mark themselves answering (:func:`mark_answering`) within one
    more ``env.timeout``: a stalled rank never does, a waiting one times out as this one did."""
    store = dist.distributed_c10d._get_default_store()
    deadline, silent = time.monotonic() + env.timeout, []
    for rank in range(env.world_size):
        if rank == env.rank:
            continue
        try:
            left = max(deadline - time.monotonic(), 0.001)
            store.wait([_ANSWERED_KEY.format(rank=rank)], timedelta(seconds=left))
        except RuntimeError:  # not within the timeout (or the store is gone)
            silent.append(rank)
    return silent


@contextlib.contextmanager
def main_rank_first(env: ParallelEnv) -> Iterator[None]:
    """Run the block on rank 0 first, then on the other ranks, which may read what it wrote. If
    it fails on rank 0, rank 0 leaves the group and the others stop at the barrier."""
    if env.distributed and not env.is_main:
        dist.barrier()
    yield
    if env.distributed and env.is_main:
        dist.barrier()


def claim_failure() -> bool:
    """Record that this rank stopped on an error; True when it is the first rank to do so (it
    reports the error), False when another rank failed before it (or the run is gone)."""
    try:
        return dist.distributed_c10d._get_default_store().add(_FAILED_KEY, 1) == 1
    except (RuntimeError, ValueError):  # the store's host has exited (or the group): a peer stopped first
        return False


def mixed_precision_policy(device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's precision: on CUDA parameters are gathered and computed in BF16 and gradients
    reduced in FP32 (the sharded parameters and AdamW's state stay FP32); on CPU all FP32."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: nn.Module, device: torch.device, low_precision_all_gather: bool = False) -> MixedPrecisionPolicy:
    """FSDP2 in place: ``fully_shard`` each transformer block, then the root (embedding, final
    norm, LM head), all with :func:`mixed_precision_policy`; returns the policy.
    ``low_precision_all_gather``: AdaHOPLinear weights are gathered as their quantized GEMM
    operands where that is bit-identical (``adahop.nn.fsdp``)."""
    policy = mixed_precision_policy(device)
    if low_precision_all_gather:
        fsdp.low_precision_all_gather(model)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return policy


def describe_sharding(model: nn.Module) -> str:
    """The process group and the precision each FSDP2 unit of ``model`` holds (read back from
    FSDP's own state, not from the policy asked for), and how many weights the low-precision
    all-gather serves, for the run's log."""
    policies = {}
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        if state is not None:
            policy = state._mp_policy
            key = (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)
            policies[key] = policies.get(key, 0) + 1
    name = lambda dtype: "as stored" if dtype is None else str(dtype).removeprefix("torch.")  # noqa: E731
    units = "; ".join(
        f"{n} units with params {name(p)}, reduce {name(r)}" + (f", output {name(o)}" if o is not None else "")
        for (p, r, o), n in policies.items()
    )
    low = fsdp.low_precision_weights(model)
    gathers = (
        f"; {low} AdaHOPLinear weights gathered as their quantized GEMM operands where the plan allows" if low else ""
    )
    return f"backend {dist.get_backend()}, {dist.get_world_size()} ranks, FSDP2 MixedPrecisionPolicy: {units or 'no FSDP units'}{gathers}"


def all_ranks_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all ranks (gloo has no ``ReduceOp.AVG``)."""
    total = value.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def gather_floats(device: torch.device, *values: float) -> list[list[float]]:
    """Each rank's ``values``, in rank order, on every rank (``device``: the rank's, as nccl
    reduces CUDA tensors only)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]
