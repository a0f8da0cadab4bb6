"""Two quality knobs from the field, each off by default: the late switch of the forward to BF16
(``recipe.bf16_forward_after``) and weight de-oscillation (``recipe.osci_reset``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adahop import quantize_mx
from adahop.nn import AdaHOPLinear, OsciReset, set_bf16_forward
from adahop.recipes import Recipe
from adahop.train import Trainer, load_config, read_metrics
import adahop.train.trainer as trainer_module
from adahop.train import checkpoint as ckpt
from adahop.transforms import hadamard_transform


class Interrupted(Exception):
    pass


def train_until_cut_off(cfg, monkeypatch, after: int) -> None:
    """Train ``cfg`` until the step-``after`` checkpoint is written, then stop as a crash would."""

    def save_then_crash(path, state):
        ckpt.save_checkpoint(path, state)
        if state["step"] == after:
            raise Interrupted

    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(trainer_module, "save_checkpoint", save_then_crash)
        Trainer(cfg, progress=False).train()


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
    train_until_cut_off(cfg, monkeypatch, after=4)
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


# ---- osci_reset ---------------------------------------------------------------------------------
def quantized_forward_weight(layer, rotate):
    """W as the forward's MXFP4 quantizer sees it (after its Hadamard if ``rotate``), dequantized."""
    w = layer.weight.detach().float()
    return quantize_mx(hadamard_transform(w) if rotate else w).dequantize()


@pytest.mark.parametrize(("recipe", "rotate"), [("mxfp4", False), ("mxfp4_hadamard", True)])
def test_osci_reset_stops_a_weight_oscillating_across_a_rounding_boundary(recipe, rotate):
    """Element (0, 0) of the forward's (rotated) W sits on the boundary between E2M1's 2 and 3 and
    SGD pushes it back and forth across: its quantized value flips every step. Element (0, 2) drifts
    the same distance one way only. With OsciReset the first is reset onto the grid after a few
    reversals and stops flipping; the second, and every other weight, follow plain SGD exactly."""
    runs = {}
    for threshold in (None, 0.05):
        layer = AdaHOPLinear(64, 32, bias=False, recipe=recipe)
        target = torch.zeros(32, 64)
        target[:, 1] = 6.0  # every block's amax: scale 1 on every step
        target[0, 0], target[0, 2] = 2.51, 1.01
        step = torch.zeros(32, 64)
        step[0, 0], step[0, 2] = 0.04, 0.04
        rotate_back = hadamard_transform if rotate else (lambda t: t)  # H/sqrt(n) is its own inverse
        layer.weight.data.copy_(rotate_back(target))
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
        osci = OsciReset(layer, threshold) if threshold else None
        if osci:
            osci.attach(opt)
        seen = []
        for i in range(30):
            grad = step.clone()
            grad[0, 0] *= 1 if i % 2 == 0 else -1  # back and forth
            grad[0, 2] *= -1  # one way
            layer.weight.grad = rotate_back(grad)
            opt.step()
            seen.append(quantized_forward_weight(layer, rotate))
        runs[threshold] = layer, seen
    plain, reset = runs[None][1], runs[0.05][1]
    assert len({q[0, 0].item() for q in plain[-10:]}) == 2  # still flipping at the end
    assert len({q[0, 0].item() for q in reset[-10:]}) == 1  # settled
    assert all(torch.equal(a[0, 2], b[0, 2]) for a, b in zip(plain, reset))  # the drifting one untouched
    w_plain, w_reset = (runs[t][0].weight.detach() for t in (None, 0.05))
    moved = (hadamard_transform(w_reset - w_plain) if rotate else w_reset - w_plain).abs() > 1e-5
    assert moved.nonzero().tolist() == [[0, 0]]  # only the oscillating element was touched


def test_osci_reset_is_validated_and_attached_by_the_trainer(small_overrides, tmp_path, one_thread):
    for bad in (0, 1, -0.5, "often"):
        with pytest.raises(ValueError, match="must be a reversal rate per step in \\(0, 1\\)"):
            Recipe(osci_reset=bad)
    trainer = Trainer(
        load_config(None, small_overrides(tmp_path, recipe="mxfp4", recipe__osci_reset=0.05)), progress=False
    )
    trainer.train()
    assert trainer.osci_reset is not None and trainer.osci_reset.resets is not None
    assert set(trainer.osci_reset.tracks) == set(trainer.named_layers)  # every layer tracked from step 1
    assert (
        Trainer(load_config(None, small_overrides(tmp_path / "off", recipe="mxfp4")), progress=False).osci_reset is None
    )


def test_a_resumed_run_resets_the_same_weights_as_an_uninterrupted_one(
    small_overrides, tmp_path, monkeypatch, one_thread
):
    """The de-oscillation state (last quantized values, directions, reversal rates, the count) is
    in the checkpoint: interrupted after step 4 and resumed, the run resets the same elements in
    steps 5 and 6 as the straight run, so every loss, weight and track is bit-identical."""

    def run(out, crash_after=None):
        cfg = load_config(None, small_overrides(out, recipe="mxfp4", recipe__osci_reset=0.001))
        if crash_after is None:
            trainer = Trainer(cfg, progress=False)
        else:
            train_until_cut_off(cfg, monkeypatch, after=crash_after)
            trainer = Trainer(cfg, resume=True, progress=False)
            assert trainer.step == crash_after and trainer.osci_reset.resets > 0  # resets before the cut too
        counts = []  # after each step's de-oscillation (the hook attached before this one); none in step 1
        osci = trainer.osci_reset
        trainer.optimizer.register_step_post_hook(lambda *_: counts.append(int(osci.resets or 0)))
        trainer.train()
        return trainer, counts

    straight, straight_counts = run(tmp_path / "straight")
    resumed, resumed_counts = run(tmp_path / "resumed", crash_after=4)
    assert straight_counts[-2] < straight_counts[-1] and straight_counts[-2:] == resumed_counts  # resets in 5 and 6
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    tracks = straight.osci_reset.state_dict()["tracks"]
    assert (
        tracks.keys()
        == resumed.osci_reset.state_dict()["tracks"].keys()
        == {f"{name}.{field}" for name in straight.named_layers for field in ("last", "direction", "rate")}
    )
    for key, value in tracks.items():
        assert torch.equal(value, resumed.osci_reset.state_dict()["tracks"][key]), key
