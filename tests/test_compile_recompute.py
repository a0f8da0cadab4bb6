"""``training.recompute_wgrad_operands``: a compiled block makes wgrad's operand in backward from a
recomputed X instead of keeping it (``adahop.nn.compiling``).

What the block keeps is read where Inductor's partitioner chose it (the forward graph's extra outputs,
as ``benchmarks/linear/saved_bytes.py`` counts them), and where the compiled step saves it
(``saved_tensors_hooks`` see what the compiled function saves); the numbers are compared bit for bit
with the pass off, Inductor's CPU code included.
"""

from __future__ import annotations

import copy

import pytest
import torch

from adahop.bench.kept import kept_for_backward
from adahop.models import build_model
from adahop.nn import adahop_layers, convert_model
from adahop.nn.compiling import WGRAD_OPERAND, compile_options
from adahop.policy.strategies import LayerPlan

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


def test_compiled_block_keeps_no_wgrad_operand_with_the_pass():
    """Off, the block keeps each wgrad operand as the forward made it; on, none of them, and nothing new
    in their place (X is recomputed from what the block keeps anyway: its input and RMSNorm's statistics,
    w1's and w3's outputs, the attention output). What goes is exactly those operands' bytes, and the
    forward no longer runs the ops that made them (they run in backward)."""
    block = _model().layers[0]
    (off, forward_off), (on, forward_on) = _kept(block, recompute=False), _kept(block, recompute=True)
    assert forward_off > 0 and forward_on == 0
    assert set(on) < set(off)
    assert not any(marked for _, marked in on.values())
    assert any(marked for _, marked in off.values())
    channels = 64 * TOKENS * 2 + 64 * 8  # OE-right's 64 extracted rows of Xᵀ in BF16 and their indices
    expected = (
        TOKENS * DIM * 2  # the attention norm's output in BF16, wq/wk/wv's BF16 wgrad operand
        + 2 * (_mxfp4_bytes(DIM, TOKENS) + channels)  # wo's and w1/w3's OE-right Xᵀ
        + _mxfp4_bytes(HIDDEN, TOKENS)  # w2's Xᵀ
    )
    assert sum(off[name][0] for name in set(off) - set(on)) == expected


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
    """``training.recompute_wgrad_operands`` reaches the blocks' ``torch.compile`` as the Inductor pass
    (compiling itself is skipped here: the blocks then run eagerly)."""
    from adahop.models.llama import Transformer
    from adahop.nn.compiling import RecomputeWgradOperands
    from adahop.train import Trainer, load_config

    asked = []
    monkeypatch.setattr(Transformer, "compile_blocks", lambda self, backend, options=None: asked.append(options))
    for on in (False, True):
        extra = {"training__compile": True, "training__recompute_wgrad_operands": on, "training__steps": 1}
        run = tmp_path / str(on)
        Trainer(load_config(None, small_overrides(run, recipe="mxfp4_hadamard", **extra)), progress=False).train()
    off, on = asked
    assert off == {} and isinstance(on["joint_custom_post_pass"], RecomputeWgradOperands)


def _run(model: torch.nn.Module, recompute: bool, tokens: torch.Tensor) -> tuple[int, list, list]:
    """Bytes the compiled step saves for backward, its losses over two steps and the gradients."""
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    model.compile_blocks(options=compile_options(recompute))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)  # the same stochastic-rounding keys in both runs
    losses = []
    for _ in range(2):  # accumulated: the second step's keys are fresh draws
        saved = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    return saved, losses, [p.grad for p in model.parameters()]


@pytest.mark.slow
def test_recomputed_wgrad_operands_train_bit_identically():
    """Inductor's CPU code, forward and backward, with dY rounded stochastically: the same losses and every
    gradient bit for bit with the pass and without, and less saved for backward."""
    model = _model()
    tokens = torch.randint(0, 256, (2, TOKENS // 2 + 1), generator=torch.Generator().manual_seed(2))
    saved_off, losses_off, grads_off = _run(model, False, tokens)
    saved_on, losses_on, grads_on = _run(model, True, tokens)
    assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on))
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
    assert saved_on < saved_off


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
