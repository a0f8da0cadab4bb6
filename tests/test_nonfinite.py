"""Non-finite steps are refused on the device and reported later (``adahop.train.nonfinite``).

The training step reads no value on the host; a non-finite gradient changes no weight and no
optimizer state, nor does any step after it; the run stops at its next read, naming the step that
went bad, before writing a checkpoint; and it resumes from the last good one as if nothing happened.

The tests run with the single-tensor AdamW of CPU runs and with the fused AdamW the trainer uses on
CUDA (by its CPU kernel here), on plain and on FSDP2-sharded parameters; on a GPU the trainer
tests also run on CUDA itself.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from adahop.train import NonFiniteLossError, Trainer, latest_checkpoint, load_config, read_metrics
from adahop.train import optim
from adahop.train import trainer as trainer_module
from adahop.train.nonfinite import PendingSteps, step_unless_non_finite

pytestmark = pytest.mark.usefixtures("one_thread")

NAN = float("nan")


def assert_same(a, b) -> None:
    """``a`` and ``b`` hold the same values, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---- the device-side refusal -----------------------------------------------------------------
def adamw(fused: bool) -> torch.optim.AdamW:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused)


def params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def set_grads(optimizer: torch.optim.Optimizer, seed: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params(optimizer):
        p.grad = torch.randn(p.shape, generator=g)
    if poison:
        params(optimizer)[0].grad[0, 0] = NAN


def snapshot(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in params(optimizer)], copy.deepcopy(optimizer.state_dict()["state"])


FINITE = (torch.tensor(2.5), torch.tensor(1.5))  # a loss and a gradient norm


@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_a_kept_step_is_the_optimizers_own_and_a_refused_one_changes_nothing(fused):
    guarded, plain = adamw(fused), adamw(fused)
    found_inf = torch.zeros(())
    for seed in range(3):
        set_grads(guarded, seed)
        set_grads(plain, seed)
        plain.step()
        step_unless_non_finite(guarded, found_inf, *FINITE)
    assert_same(snapshot(guarded), snapshot(plain))  # bit for bit: CPU runs keep their numerics

    before = snapshot(guarded)
    set_grads(guarded, 3, poison=True)
    step_unless_non_finite(guarded, found_inf, torch.tensor(2.5), torch.tensor(NAN))
    assert found_inf.item() == 1
    assert_same(snapshot(guarded), before)
    set_grads(guarded, 4)  # finite again, but after a bad step: refused too
    step_unless_non_finite(guarded, found_inf, *FINITE)
    assert_same(snapshot(guarded), before)


@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_a_refused_first_step_leaves_the_optimizer_as_new(fused):
    """The first step creates the optimizer's state; refused, it is the state a new one starts from."""
    refused, fresh = adamw(fused), adamw(fused)
    weights = [p.detach().clone() for p in params(refused)]
    set_grads(refused, 0)
    step_unless_non_finite(refused, torch.zeros(()), torch.tensor(math.inf), torch.tensor(1.0))
    assert_same([p.detach() for p in params(refused)], weights)
    for state in refused.state.values():
        assert all(not value.any() for value in state.values())  # step 0, zero moments
    set_grads(refused, 1)
    set_grads(fresh, 1)
    step_unless_non_finite(refused, torch.zeros(()), *FINITE)
    fresh.step()
    assert_same(snapshot(refused), snapshot(fresh))


def full_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and state tensor, gathered whole from its shards where sharded."""
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [*params(optimizer), *(v for state in optimizer.state.values() for v in state.values())]
    return [whole(t).detach().clone() for t in tensors]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_a_step_on_fsdp2_shards_is_refused_alike(fused, tmp_path):
    """Under FSDP2 the parameters and moments are DTensors; the flag, a plain scalar, is
    replicated over them (one process over gloo)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        found_inf = torch.zeros(())
        for loss in (1.0, NAN):
            before = full_state(optimizer)
            model(torch.randn(2, 8)).sum().backward()
            step_unless_non_finite(optimizer, found_inf, torch.tensor(loss), torch.tensor(1.0))
            optimizer.zero_grad()
        assert isinstance(params(optimizer)[0], DTensor)
        assert_same(full_state(optimizer), before)
    finally:
        dist.destroy_process_group()


def test_pending_steps_are_read_oldest_first_and_once():
    pending = PendingSteps()
    pending.add(1, 0.1, torch.tensor(2.0), torch.tensor(0.5))
    pending.add(2, 0.2, torch.tensor(NAN), torch.tensor(0.25))
    first, second = pending.read()
    assert (first.step, first.lr, first.loss, first.grad_norm, first.finite) == (1, 0.1, 2.0, 0.5, True)
    assert second.step == 2 and math.isnan(second.loss) and not second.finite
    assert pending.read() == []


# ---- in the trainer --------------------------------------------------------------------------
@pytest.fixture(
    params=[
        "single-tensor",
        "fused",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ]
)
def kind(request, monkeypatch) -> str:
    if request.param == "fused":  # the optimizer build_optimizer makes for CUDA, on the CPU's parameters
        monkeypatch.setattr(
            trainer_module,
            "build_optimizer",
            lambda model, cfg, device: optim.build_optimizer(model, cfg, torch.device("cuda")),
        )
    return request.param


def config(small_overrides, out, kind: str):
    """8 steps of a fixed recipe, read on the host every 4 (log, validation and checkpoint)."""
    return load_config(
        None,
        small_overrides(
            out,
            recipe="mxfp4",
            training__device="cuda" if kind == "cuda" else "cpu",
            training__steps=8,
            logging__log_every=4,
            logging__val_every=4,
            checkpoint__interval=4,
        ),
    )


class ScalarReads(TorchDispatchMode):
    """Calls ``note(tensor)`` for each scalar read on the host (``item``, ``bool``, ``float``,
    ``int`` and comparisons in ``if`` all run ``aten._local_scalar_dense``)."""

    def __init__(self, note: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note(args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_cuda_sync(trainer: Trainer) -> Iterator[None]:
    """On CUDA, once the micro-step replays as a graph (capture itself synchronises), any
    synchronising call is an error."""
    if trainer.device.type != "cuda" or not trainer.graph_captured:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_steps_read_nothing_on_the_host_between_reads(kind, small_overrides, tmp_path, monkeypatch):
    """Every host read of a value on the training device (scalar reads, ``tolist``, ``numpy``) is
    recorded with where it happened: none inside ``train_step``, and outside it only at steps 4 and 8. The step counts
    of a non-fused optimizer are read by it, but live on the host by design (on CUDA too)."""
    trainer = Trainer(config(small_overrides, tmp_path / "run", kind), progress=False)
    reads: list[tuple[str, int]] = []
    where = "loop"

    def note(tensor: torch.Tensor) -> None:
        # On CUDA only a read of a device tensor waits for the device: the kernels' launch plans
        # read small host tables once, on their first call (the eager warm-up of step 1).
        if tensor.device.type != trainer.device.type:
            return
        if not any(tensor is state.get("step") for state in trainer.optimizer.state.values()):
            reads.append((where, trainer.step))

    train_step = Trainer.train_step

    def observed(self):
        nonlocal where
        where = "step"
        try:
            with no_cuda_sync(self):
                return train_step(self)
        finally:
            where = "loop"

    monkeypatch.setattr(Trainer, "train_step", observed)
    for name in ("tolist", "numpy"):
        read = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _read=read, **k: (note(self), _read(self, *a, **k))[1])
    with ScalarReads(note):
        trainer.train()
    assert [r for r in reads if r[0] == "step"] == []
    assert {step for _, step in reads} == {4, 8}


def test_a_non_finite_gradient_changes_nothing_and_stops_the_run_naming_its_step(
    kind, small_overrides, tmp_path, monkeypatch
):
    """NaN in one gradient entry of step 6: steps 6 to 8 are refused on the device; the read at
    step 8 stops the run before its checkpoint, naming step 6 and the step-4 checkpoint. The
    weights and the optimizer state are those before step 6, bit for bit; resumed from step 4,
    the run gives the figures of one that never went bad (bit for bit on the CPU)."""
    run, clean = tmp_path / "run", tmp_path / "clean"
    before: dict = {}
    micro_step = Trainer._micro_step

    def poisoned(self, inputs, targets, **kwargs):
        loss = micro_step(self, inputs, targets, **kwargs)
        if self.step + 1 == 6 and not before:  # after step 6's backward, before its update
            before.update(
                model=copy.deepcopy(self.model.state_dict()),
                optimizer=copy.deepcopy(self.optimizer.state_dict()["state"]),
            )
            self.model.tok_embeddings.weight.grad[0, 0] = NAN
        return loss

    monkeypatch.setattr(Trainer, "_micro_step", poisoned)
    trainer = Trainer(config(small_overrides, run, kind), progress=False)
    with pytest.raises(
        NonFiniteLossError,
        match=r"^gradient norm is nan at step 6 with recipe 'mxfp4' .*Last good checkpoint: .*step_0000004\.pt",
    ):
        trainer.train()
    assert trainer.step == 8  # where it was read
    assert_same(trainer.model.state_dict(), before["model"])
    assert_same(trainer.optimizer.state_dict()["state"], before["optimizer"])
    assert latest_checkpoint(run).name == "step_0000004.pt"
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [4]
    assert (run / "loss.png").exists()

    Trainer(config(small_overrides, run, kind), resume=True, progress=False).train()  # the poison was one-shot
    if kind == "cuda":  # GPU kernels need not be deterministic
        return
    Trainer(config(small_overrides, clean, kind), progress=False).train()
    assert figures(run) == figures(clean)


def figures(run) -> list[tuple]:
    return [(r["kind"], r["step"], r["loss"], r.get("grad_norm"), r.get("lr")) for r in read_metrics(run)]
