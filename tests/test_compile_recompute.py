"""``training.recompute_wgrad_operands``: a compiled block makes wgrad's operand in backward from a
recomputed X instead of keeping it (``adahop.nn.compiling``).

What the block keeps is read where Inductor's partitioner chose it (the forward graph's extra outputs,
as ``benchmarks/linear/saved_bytes.py`` counts them), and where the compiled step saves it
(``saved_tensors_hooks`` see what the compiled function saves); the numbers are compared bit for bit
with the pass off, Inductor's CPU code included; and on two CPU ranks under FSDP2 (``fully_shard`` per
block, gloo), in the trainer's order (shard, then compile) and torchtitan's (compile, then shard).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from adahop.bench.kept import kept_for_backward
from adahop.models import build_model
from adahop.nn import adahop_layers, convert_model
from adahop.nn.compiling import WGRAD_OPERAND, compile_options
from adahop.policy.strategies import LayerPlan
from adahop.train.distributed import shard_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Wide enough that OE-right's 64 channels are a fraction of X (the partitioner keeps X itself where not).
DIM, HEADS, HIDDEN, TOKENS = 256, 4, 512, 64  # 2 sequences of 32
# Every kind of wgrad operand: a BF16 X shared by three layers (lv2's wq/wk/wv), OE-right's Xᵀ with its
# extracted channels (wo, and w1/w3 sharing one), Xᵀ in plain MXFP4 (w2).
PLANS = {
    "wq": ("iht", "oe_left", "bf16"),
    "wk": ("iht", "oe_left", "bf16"),
    "wv": ("iht", "oe_left", "bf16"),
    "wo": ("iht", "iht", "oe_right"),
    "w1": ("iht", "iht", "oe_right"),
    "w3": ("iht", "iht", "oe_right"),
    "w2": ("mxfp4", "oe_right", "mxfp4"),
}


def _model(backward_rounding: str = "nearest") -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = {"n_layers": 1, "dim": DIM, "n_heads": HEADS, "n_kv_heads": HEADS // 2, "ffn_hidden": HIDDEN}
    model = build_model("tiny", vocab_size=256, **overrides)
    convert_model(model, {"name": "adahop_lv2", "backward_rounding": backward_rounding})
    for name, layer in adahop_layers(model).items():
        layer.set_plan(LayerPlan(*PLANS[name.rsplit(".", 1)[-1]]))
    return model


def _marked(node: torch.fx.Node) -> bool:
    return (node.meta.get("custom") or {}).get("adahop") == WGRAD_OPERAND


def _kept(block: torch.nn.Module, recompute: bool) -> tuple[dict[str, tuple[int, bool]], int]:
    """What the compiled block's forward hands its backward, parameters left out: name -> (bytes, whether
    a wgrad-operand node made it); and how many wgrad-operand ops its forward graph runs."""
    torch._dynamo.reset()
    compiled = torch.compile(block, dynamic=False, options=compile_options(recompute) or None)
    x = torch.zeros(2, TOKENS // 2, DIM, requires_grad=True)
    rope = torch.ones(TOKENS // 2, DIM // HEADS // 2), torch.zeros(TOKENS // 2, DIM // HEADS // 2)
    params = {tuple(p.shape) for p in block.parameters()}

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(x, *rope)

    chosen = kept_for_backward(run)
    kept = {}
    for node in chosen:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not (node.op == "placeholder" and tuple(value.shape) in params):
            kept[node.name] = (value.untyped_storage().nbytes(), _marked(node))
    forward = chosen[0].graph
    return kept, sum(node.op == "call_function" and _marked(node) for node in forward.nodes)


def _mxfp4_bytes(rows: int, k: int) -> int:
    """Packed E2M1 codes and one E8M0 scale per 32 of ``rows`` x ``k``."""
    return rows * k // 2 + rows * k // 32


def _assert_exactly_the_wgrad_operands_move(off: tuple[dict, int], on: tuple[dict, int]) -> None:
    """Off, the block keeps each wgrad operand as the forward made it; on, none of them, and nothing new
    in their place (X is recomputed from what the block keeps anyway: its input and RMSNorm's statistics,
    w1's and w3's outputs, the attention output). What goes is exactly those operands' bytes, and the
    forward no longer runs the ops that made them (they run in backward). ``off``, ``on``: :func:`_kept`'s."""
    (kept_off, forward_off), (kept_on, forward_on) = off, on
    assert forward_off > 0 and forward_on == 0
    assert set(kept_on) < set(kept_off)
    assert not any(marked for _, marked in kept_on.values())
    assert any(marked for _, marked in kept_off.values())
    channels = 64 * TOKENS * 2 + 64 * 8  # OE-right's 64 extracted rows of Xᵀ in BF16 and their indices
    expected = (
        TOKENS * DIM * 2  # the attention norm's output in BF16, wq/wk/wv's BF16 wgrad operand
        + 2 * (_mxfp4_bytes(DIM, TOKENS) + channels)  # wo's and w1/w3's OE-right Xᵀ
        + _mxfp4_bytes(HIDDEN, TOKENS)  # w2's Xᵀ
    )
    assert sum(kept_off[name][0] for name in set(kept_off) - set(kept_on)) == expected


def test_compiled_block_keeps_no_wgrad_operand_with_the_pass():
    block = _model().layers[0]
    _assert_exactly_the_wgrad_operands_move(_kept(block, recompute=False), _kept(block, recompute=True))


def test_pass_leaves_an_input_it_cannot_recompute_quantized():
    """Two layers in a row: the first's X is the graph's input, the second's the first's GEMM output plus its
    bias (an add whose input only X needs), so recomputing either would keep a full-precision tensor in place
    of the quantized Xᵀ: the pass leaves both as they are."""
    torch.manual_seed(0)
    model = convert_model(torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Linear(HIDDEN, DIM)), "mxfp4")
    x = torch.randn(TOKENS, DIM, requires_grad=True)

    def kept(recompute: bool) -> list[str]:
        torch._dynamo.reset()
        compiled = torch.compile(model, dynamic=False, options=compile_options(recompute) or None)
        return [node.name for node in kept_for_backward(lambda: compiled(x))]

    assert kept(True) == kept(False)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_pass_leaves_stochastic_xt_and_checkpointed_blocks_as_they_are(checkpointed):
    """A layer whose Xᵀ rounds stochastically keeps it (the partitioner would draw its key again in
    backward); a block under activation checkpointing keeps its input only, with the pass or without."""
    model = _model("stochastic" if not checkpointed else "nearest")
    model.recompute = checkpointed
    block = model.layers[0]
    assert _kept(block, recompute=True)[0] == _kept(block, recompute=False)[0]


def test_trainer_compiles_blocks_with_the_pass_when_asked(small_overrides, tmp_path, monkeypatch):
    """``training.recompute_wgrad_operands`` reaches the blocks' ``torch.compile`` as the Inductor pass,
    and the loss is compiled with them (compiling itself is skipped here: the model then runs eagerly)."""
    from adahop.models.llama import Transformer
    from adahop.nn.compiling import RecomputeWgradOperands
    from adahop.train import Trainer, load_config

    asked, losses = [], []
    monkeypatch.setattr(Transformer, "compile_blocks", lambda self, backend, options=None: asked.append(options))
    monkeypatch.setattr(Transformer, "compile_loss", lambda self, backend: losses.append(backend))
    for on in (False, True):
        extra = {"training__compile": True, "training__recompute_wgrad_operands": on, "training__steps": 1}
        run = tmp_path / str(on)
        Trainer(load_config(None, small_overrides(run, recipe="mxfp4_hadamard", **extra)), progress=False).train()
    off, on = asked
    assert off == {} and isinstance(on["joint_custom_post_pass"], RecomputeWgradOperands)
    assert losses == ["inductor", "inductor"]


def _train(model: torch.nn.Module, recompute: bool, batches: torch.Tensor, shard: str = "") -> tuple[int, list, list]:
    """Compiled blocks, one optimizer step per batch of ``batches``: the bytes the last step saved for
    backward, the losses, and each step's gradients (whole tensors under FSDP2). ``shard``: "" (one
    process), "then_compile" (the trainer's order: ``shard_model``, then ``compile_blocks``) or
    "compiled_first" (torchtitan's: each block compiled, then ``fully_shard``)."""
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    if shard == "then_compile":
        shard_model(model, torch.device("cpu"))
    model.compile_blocks(options=compile_options(recompute))
    if shard == "compiled_first":
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)  # the same stochastic-rounding keys in both runs
    losses, grads = [], []
    for tokens in batches:  # the second step's keys are fresh draws, on updated weights
        saved = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append(
            [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in model.parameters()]
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return saved, losses, grads


def _batches(sequences: int) -> torch.Tensor:
    """Two steps' token batches of ``sequences`` sequences of 33 tokens."""
    return torch.randint(0, 256, (2, sequences, TOKENS // 2 + 1), generator=torch.Generator().manual_seed(2))


def _assert_bit_identical_and_saves_less(off: tuple[int, list, list], on: tuple[int, list, list]) -> None:
    """:func:`_train`'s results without the pass and with it."""
    (saved_off, losses_off, grads_off), (saved_on, losses_on, grads_on) = off, on
    assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on, strict=True))
    for step_off, step_on in zip(grads_off, grads_on, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_off, step_on, strict=True))
    assert saved_on < saved_off


@pytest.mark.slow
def test_recomputed_wgrad_operands_train_bit_identically():
    """Inductor's CPU code, forward and backward, with dY rounded stochastically: two optimizer steps give
    the same losses and every gradient bit for bit with the pass and without, and less saved for backward."""
    model, batches = _model(), _batches(2)
    _assert_bit_identical_and_saves_less(_train(model, False, batches), _train(model, True, batches))


FSDP_WORLD = 2
FSDP_ORDERS = ("then_compile", "compiled_first")


def _fsdp_rank(rank: int, init: str, out: str) -> None:
    """One rank: what its sharded block keeps (shard, then compile), and two optimizer steps on its two
    sequences of each global batch in both orders, without the pass and with it."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=FSDP_WORLD)
    torch.set_num_threads(1)
    result = {}
    for recompute in (False, True):
        model = _model()  # a fresh one each time: the partition is recorded mid-forward
        shard_model(model, torch.device("cpu"))
        result["kept", recompute] = _kept(model.layers[0], recompute)
    model, batches = _model(), _batches(2 * FSDP_WORLD)[:, 2 * rank : 2 * rank + 2]
    for order in FSDP_ORDERS:
        for recompute in (False, True):
            result[order, recompute] = _train(model, recompute, batches, shard=order)
    torch.save(result, f"{out}.{rank}")
    dist.barrier()  # tear down together (see tests/test_fsdp.py)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_recompute")
    out = str(tmp / "result")
    init = f"file://{tmp}/rendezvous"
    mp.start_processes(_fsdp_rank, args=(init, out), nprocs=FSDP_WORLD, start_method="spawn")
    return [torch.load(f"{out}.{rank}") for rank in range(FSDP_WORLD)]


no_distributed = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
@no_distributed
@pytest.mark.parametrize("rank", range(FSDP_WORLD))
def test_fsdp2_sharded_block_keeps_no_wgrad_operand_with_the_pass(fsdp_ranks, rank):
    """A block under ``fully_shard`` (its parameters gathered by FSDP2 for the compiled graph) keeps
    what a plain one keeps: the pass moves exactly the same operands."""
    _assert_exactly_the_wgrad_operands_move(fsdp_ranks[rank]["kept", False], fsdp_ranks[rank]["kept", True])


@pytest.mark.slow
@no_distributed
@pytest.mark.parametrize("order", FSDP_ORDERS)
@pytest.mark.parametrize("rank", range(FSDP_WORLD))
def test_fsdp2_sharded_blocks_train_bit_identically_with_the_pass(fsdp_ranks, rank, order):
    """Two ranks, two optimizer steps, gradients reduce-scattered: each rank's losses and the whole
    gradients bit for bit with the pass and without, and less saved for backward."""
    _assert_bit_identical_and_saves_less(fsdp_ranks[rank][order, False], fsdp_ranks[rank][order, True])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphed", [False, True])
def test_gpu_recomputed_wgrad_operands_train_bit_identically(graphed):
    """On the GPU's torch and Triton code, compiled blocks alone and replayed as CUDA graphs (the step
    bench's fastest mode): three optimizer steps with the pass and without give the same losses and
    weights bit for bit (the math attention kernel: the fused ones' backward need not repeat itself), and
    the pass saves less for backward. Where this fails, the partitioner of this torch chose differently."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adahop.train.graphs import GraphedMicroStep

    tokens = torch.randint(0, 256, (3, 4, 129), generator=torch.Generator().manual_seed(2)).cuda()

    def train(recompute: bool) -> tuple[list[float], list[torch.Tensor], int]:
        model = _model().cuda()
        model.compile_blocks(options=compile_options(recompute))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = GraphedMicroStep(model) if graphed else None
        saved, losses = 0, []

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.untyped_storage().nbytes()
            return t

        torch.manual_seed(1)
        for batch in tokens:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with sdpa_kernel(SDPBackend.MATH):
                if step is not None:
                    losses.append(step(inputs, targets).item())
                else:
                    saved = 0
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            _, loss = model(inputs, targets)
                    loss.backward()
                    losses.append(loss.item())
            opt.step()
            if step is None:
                opt.zero_grad(set_to_none=True)
        return losses, [p.detach().clone() for p in model.parameters()], saved

    torch._dynamo.reset()
    losses_off, weights_off, saved_off = train(False)
    torch._dynamo.reset()
    losses_on, weights_on, saved_on = train(True)
    assert losses_on == losses_off
    assert all(torch.equal(a, b) for a, b in zip(weights_off, weights_on))
    if not graphed:
        assert saved_on < saved_off
