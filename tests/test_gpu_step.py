"""CUDA-graph training micro-steps against eager ones (GPU only; the H200 logs are in benchmarks/step/)."""

import contextlib

import pytest
import torch

from adahop import end_calibration_step
from adahop.models import build_model
from adahop.nn import adahop_layers, convert_model
from adahop.train.graphs import GraphedMicroStep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB, BATCH, SEQ = 512, 4, 128
CALIBRATION = 2


def _model(recipe: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=VOCAB).cuda()
    return convert_model(model, {"calibration_steps": CALIBRATION} | recipe)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n, BATCH, SEQ + 1), generator=g).cuda()
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _eager_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, accum: int = 1) -> float:
    # A function of its own, so that no tensor of this step's autograd graph outlives it: a graph
    # kept alive keeps AccumulateGrad nodes bound to the default stream, which capture refuses.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(inputs, targets)
    (loss / accum).backward()
    return loss.item()


def _losses(model: torch.nn.Module, batches, graphed: bool, accum: int = 1) -> list[float]:
    """Calibrate eagerly, then train on ``batches`` (``accum`` micro-batches per optimizer step)
    eagerly or through CUDA graphs, as the trainer does: the graphs own ``.grad``, so it is never
    zeroed; the first micro-step of a step overwrites it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = None  # made once the plan froze: GraphedMicroStep refuses a calibrating model
    losses = []
    for i, (inputs, targets) in enumerate(batches):
        frozen = not any(m.calibrating for m in adahop_layers(model).values())
        if graphed and step is None and frozen and i > CALIBRATION * accum and i % accum == 0:
            step = GraphedMicroStep(model, loss_scale=1 / accum)
        if step is not None:
            losses.append(step(inputs, targets, first=i % accum == 0).item())
        else:
            losses.append(_eager_step(model, inputs, targets, accum))
        if i % accum == accum - 1:
            opt.step()
            if step is None or not step.captured:
                opt.zero_grad(set_to_none=True)
    if graphed:
        assert step is not None and step.captured
    return losses


@pytest.mark.parametrize(
    ("recipe", "tolerance"),
    [
        # Round to nearest everywhere: only the order of atomic adds may differ.
        ({"name": "mxfp4_hadamard", "grad_rounding": "nearest"}, 2e-3),
        # Stochastic rounding draws other (equally random) keys inside the graph.
        ({"name": "adahop_lv2"}, 3e-2),
    ],
)
@pytest.mark.parametrize("accum", [1, 3])
def test_graphed_steps_train_like_eager_steps(recipe, tolerance, accum):
    """With accumulation the overwriting graph and the accumulating one both run (the
    second is captured after the first, into the tensors the first one writes)."""
    batches = _batches(10 * accum)
    eager = _losses(_model(recipe), batches, graphed=False, accum=accum)
    graphed = _losses(_model(recipe), batches, graphed=True, accum=accum)
    assert max(abs(a - b) for a, b in zip(eager, graphed)) < tolerance, (eager, graphed)


@pytest.mark.parametrize(("recipe", "fresh_noise"), [("adahop_lv2", True), ("bf16", False)])
def test_every_replay_rounds_with_fresh_noise(recipe, fresh_noise):
    """The seeds are drawn on the device inside the graph, so a replay is not a copy of the last."""
    model = _model({"name": recipe})
    ((inputs, targets),) = _batches(1)
    for _ in range(CALIBRATION):  # no optimizer here: each step's end freezes through end_calibration_step
        _eager_step(model, inputs, targets)
        end_calibration_step(model)
    step = GraphedMicroStep(model)
    grads = []
    for _ in range(3):  # warm-up, capture + replay, replay
        model.zero_grad(set_to_none=False)
        step(inputs, targets)
        grads.append(model.layers[0].feed_forward.w2.weight.grad.clone())
    assert step.captured
    assert torch.equal(grads[1], grads[2]) is not fresh_noise


def test_accumulating_graph_reads_the_weight_operands_the_first_graph_writes():
    """Inside ``weight_operands_cached`` the accumulating graph is captured with no quantize call on
    W and reads W's operands where the first graph writes them on every replay: its loss is bit
    for bit an eager forward's on the same (updated) W. Round to nearest everywhere, so the forward
    is deterministic; a large learning rate, so a stale operand would change the loss."""
    from adahop import ops
    from adahop.nn import weight_operands_cached

    model, accum = _model({"name": "mxfp4_hadamard", "grad_rounding": "nearest"}), 2
    shapes = {tuple(layer.weight.shape) for layer in adahop_layers(model).values()}
    assert all(BATCH * SEQ not in shape for shape in shapes)  # no activation has a weight's shape
    calls = []
    kernels = {  # the op, and the name its eager path calls directly (ops._eager_cuda)
        ops.quantize_mx_op: "_quantize_mx_cuda",
        ops.quantize_fold_op: "_quantize_fold_cuda",
        ops.quantize_rowwise_op: "_quantize_rowwise_cuda",
    }

    def counted(kernel):
        def run(x, *args):
            calls.append(tuple(x.shape) in shapes)
            return kernel(x, *args)

        return run

    @contextlib.contextmanager
    def counting():
        """Every W quantize counted: eager CUDA calls ``ops._quantize_*_cuda`` by name, skipping the
        custom-op dispatch, and a compiled graph dispatches to the kernel registered last."""
        originals = {op: getattr(ops, name) for op, name in kernels.items()}
        try:
            for op, name in kernels.items():
                setattr(ops, name, counted(originals[op]))
                op.register_kernel("cuda")(counted(originals[op]))
            yield
        finally:
            for op, name in kernels.items():
                setattr(ops, name, originals[op])
                op.register_kernel("cuda")(originals[op])

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = GraphedMicroStep(model, loss_scale=1 / accum)
    batches = _batches(5 * accum)
    made = {}  # W quantize calls per optimizer step and micro-step
    with counting():
        for s in range(5):  # warm-up, captures, replays
            with weight_operands_cached(model):
                for i in range(accum):
                    calls.clear()
                    loss = step(*batches[s * accum + i], first=i == 0).item()
                    made[s, i] = sum(calls)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                _, eager = model(*batches[s * accum + accum - 1])
            assert loss == eager.item(), s
            opt.step()
    assert step.captured and step._operands.reuses
    layers = len(adahop_layers(model))
    assert made[0, 0] == made[1, 0] == 2 * layers  # eager, then the first graph's capture: W and Wᵀ
    assert made[0, 1] == made[1, 1] == 0  # eager, then the accumulating graph's capture: read, not made
    assert all(made[s, i] == 0 for s in (2, 3, 4) for i in range(accum))  # replays call nothing
