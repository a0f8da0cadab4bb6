"""Two quality knobs from the field, each off by default: the late switch of the forward to BF16
(``recipe.bf16_forward_after``) and weight de-oscillation (``recipe.osci_reset``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adahop.nn import AdaHOPLinear, set_bf16_forward
from adahop.recipes import Recipe
from adahop.train import Trainer, load_config, read_metrics
import adahop.train.trainer as trainer_module
from adahop.train import checkpoint as ckpt


class Interrupted(Exception):
    pass


def forward_backward(layer, x, g, seed=3):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y = layer(x)
    y.backward(g)
    grads = x.grad, layer.weight.grad.clone()
    layer.weight.grad = None
    return y.detach(), *grads


# ---- bf16_forward_after ------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", (False, True))
def test_bf16_forward_flag_runs_the_forward_in_bf16_and_keeps_the_quantized_backward(compiled):
    torch.manual_seed(0)
    layer = AdaHOPLinear(64, 48, bias=False, recipe="mxfp4")
    x, g = torch.randn(32, 64), torch.randn(32, 48)
    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    y4, dx4, dw4 = forward_backward(run, x, g)
    set_bf16_forward(layer)
    y, dx, dw = forward_backward(run, x, g)
    assert torch.equal(y, F.linear(x, layer.weight.detach())) and not torch.equal(y, y4)
    assert torch.equal(dx, dx4) and torch.equal(dw, dw4)  # dgrad and wgrad stay MXFP4, same noise
    set_bf16_forward(layer, False)
    assert torch.equal(forward_backward(run, x, g)[0], y4)  # and back (a compiled module recompiles)


def test_bf16_forward_after_is_validated():
    assert Recipe().bf16_forward_after is None
    for bad in (1.5, -0.1, "late", True):
        with pytest.raises(ValueError, match="must be a fraction of the training steps in \\[0, 1\\]"):
            Recipe(bf16_forward_after=bad)


def losses(run):
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_trainer_switches_at_the_fraction_and_a_resumed_run_switches_there_too(
    small_overrides, tmp_path, monkeypatch, one_thread
):
    def overrides(out, **extra):
        return small_overrides(out, recipe="mxfp4", **extra)

    plain = Trainer(load_config(None, overrides(tmp_path / "plain")), progress=False)
    plain.train()
    late_cfg = load_config(None, overrides(tmp_path / "late", recipe__bf16_forward_after=0.5))
    Trainer(late_cfg, progress=False).train()
    # 6 steps, switch at int(0.5 * 6) = 3: steps 1-3 as without the knob, steps 4-6 another forward.
    first, second = losses(tmp_path / "plain"), losses(tmp_path / "late")
    assert first[:3] == second[:3] and all(a != b for a, b in zip(first[3:], second[3:]))

    # Interrupted after step 4 (past the switch) and resumed: every step as in the straight run.
    cfg = load_config(None, overrides(tmp_path / "resumed", recipe__bf16_forward_after=0.5))

    def save_then_crash(path, state):
        ckpt.save_checkpoint(path, state)
        if state["step"] == 4:
            raise Interrupted

    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(trainer_module, "save_checkpoint", save_then_crash)
        Trainer(cfg, progress=False).train()
    Trainer(cfg, resume=True, progress=False).train()
    assert losses(tmp_path / "resumed") == second


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switch_recaptures_the_cuda_graphs(small_overrides, tmp_path):
    """Graphed steps before the switch replay the quantized forward: the trainer drops them and
    captures new ones, and trains as the same run without graphs does (round to nearest everywhere)."""
    runs = {}
    for graph in (False, True):
        out = tmp_path / f"graph{graph}"
        extra = {"recipe": "mxfp4_hadamard", "recipe__grad_rounding": "nearest", "recipe__bf16_forward_after": 0.5}
        cfg = load_config(None, small_overrides(out, training__device="cuda", training__cuda_graph=graph, **extra))
        trainer = Trainer(cfg, progress=False)
        trainer.train()
        runs[graph] = losses(out)
        assert trainer.graph_captured == graph
    assert max(abs(a - b) for a, b in zip(*runs.values())) < 2e-3, runs
