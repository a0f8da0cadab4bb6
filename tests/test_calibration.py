"""Calibration: votes, hooks on linear layers, the JSON model plan, and a real tiny transformer."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adahop.policy import calibration
from adahop import end_calibration_step
from adahop.policy.calibration import ModelPlan, PatternRecorder, PatternVotes, attach_pattern_hooks
from adahop.policy.patterns import NonFiniteTensorError, line_stats
from adahop.policy.strategies import LayerPlan, plan_for_patterns


@pytest.fixture
def one_thread():
    """The CI machine has 2 shared cores; tiny models run far faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- votes


def test_majority_and_counts():
    votes = PatternVotes()
    for p in ["row", "none", "row", "col", "row"]:
        votes.add("g", p)
    assert votes.count("g") == 5 and votes.count("x") == 0
    assert votes.counts("g") == {"row": 3, "col": 1, "none": 1}
    assert votes.majority("g") == "row"


def test_ties_go_to_the_latest_vote():
    votes = PatternVotes()
    for p in ["col", "none", "none", "col"]:
        votes.add("x", p)
    assert votes.majority("x") == "col"  # 2 - 2, col seen last
    votes.add("x", "none")
    assert votes.majority("x") == "none"  # 3 - 2
    votes.add("x", "col")
    votes.add("x", "row")
    assert votes.majority("x") == "col"  # 3 - 3, col seen after none


def test_votes_errors():
    votes = PatternVotes()
    with pytest.raises(ValueError, match="no 'w' votes"):
        votes.majority("w")
    with pytest.raises(ValueError, match="unknown role 'y'.*'x', 'w', 'g'"):
        votes.add("y", "row")
    with pytest.raises(ValueError, match="unknown pattern 'diag'"):
        votes.add("x", "diag")


def test_votes_state_dict_round_trip_and_plan():
    votes = PatternVotes()
    for role, p in [("x", "col"), ("x", "none"), ("x", "col"), ("w", "none"), ("g", "row"), ("g", "none")]:
        votes.add(role, p)
    restored = PatternVotes()
    restored.load_state_dict(json.loads(json.dumps(votes.state_dict())))
    assert restored.state_dict() == votes.state_dict()
    assert all(restored.majority(r) == votes.majority(r) for r in "xwg")
    assert votes.plan("lv2") == plan_for_patterns("col", "none", "none", "lv2")  # g: tie, none is latest


# ---------------------------------------------------------------- hooks


def planted_step(layer: nn.Linear, *, train=True, grad=True):
    """One step whose X has an outlier column, W an outlier row and dY an outlier token (row)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, layer.in_features, generator=gen)
    x[..., 5] *= 30
    dy = torch.randn(4, 64, layer.out_features, generator=gen)
    dy[2, 17] *= 30
    layer.train(train)
    with torch.set_grad_enabled(grad):
        y = layer(x)
        if grad:
            y.backward(dy)


def test_hooks_vote_each_tensor_in_storage_layout(monkeypatch):
    layer = nn.Linear(96, 48)
    with torch.no_grad():
        layer.weight[7] *= 30
    seen = []

    def spy(t):
        seen.append(tuple(t.shape))
        return line_stats(t)

    monkeypatch.setattr(calibration, "line_stats", spy)
    with attach_pattern_hooks(layer) as recorder:
        planted_step(layer)
        assert seen == [(256, 96), (48, 96), (256, 48)]  # X [tokens, in], W [out, in], dY [tokens, out]
        assert all(recorder.votes.count(r) == 0 for r in "xwg")  # measured in backward, voted at the boundary
        recorder.end_step()
    assert {r: recorder.votes.majority(r) for r in "xwg"} == {"x": "col", "w": "row", "g": "row"}
    assert all(recorder.votes.count(r) == 1 for r in "xwg")


def test_one_vote_per_step_from_every_micro_batch():
    """Two micro-batches, each with half of the outlier tokens: the step's vote sees them together
    (as one batch), the optimizer's step casts it, and the micro-batches add no second vote."""
    layer = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    whole = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    whole[:, 3] *= 20
    with PatternRecorder(layer) as recorder:
        for part in whole.split(128):
            layer(part).sum().backward()
        optimizer.step()
        assert [recorder.votes.count(r) for r in "xwg"] == [1, 1, 1]
        layer(whole).sum().backward()
        recorder.end_step()
    assert recorder.votes.counts("x") == {"row": 0, "col": 2, "none": 0}


def test_no_votes_in_eval_or_no_grad_or_after_remove():
    layer = nn.Linear(64, 32)
    recorder = PatternRecorder(layer)
    planted_step(layer, train=False)
    planted_step(layer, grad=False)
    recorder.end_step()
    assert all(recorder.votes.count(r) == 0 for r in "xwg")

    layer.train()
    y = layer(torch.randn(128, 64))  # forward recorded, backward still pending
    recorder.remove()
    y.sum().backward()
    planted_step(layer)
    end_calibration_step(layer)  # the recorder left the step boundaries with remove()
    assert all(recorder.votes.count(r) == 0 for r in "xwg")


def test_recorders_share_votes_and_reject_weightless_modules():
    votes = PatternVotes()
    layer = nn.Linear(64, 32)
    with PatternRecorder(layer, votes), PatternRecorder(layer, votes):
        planted_step(layer)
        end_calibration_step(layer)
    assert votes.count("x") == votes.count("g") == 2
    with pytest.raises(TypeError, match="2-D .weight"):
        PatternRecorder(nn.ReLU())


def test_non_finite_statistics_stop_at_the_step_boundary():
    layer = nn.Linear(64, 32)
    x = torch.randn(64, 64)
    x[3, 5] = float("inf")
    with PatternRecorder(layer) as recorder:
        layer(x).sum().backward()
        with pytest.raises(NonFiniteTensorError, match="input X of a calibrating layer held NaN or Inf"):
            recorder.end_step()


# ---------------------------------------------------------------- model plan


def example_plan() -> ModelPlan:
    return ModelPlan(
        {
            "layers.0.attn.qkv": plan_for_patterns("none", "none", "row", "lv1"),
            "layers.0.mlp.fc2": plan_for_patterns("col", "none", "row", "lv2"),
            "layers.1.mlp.fc1": LayerPlan.uniform("bf16"),
        }
    )


def test_plan_json_and_file_round_trip(tmp_path):
    plan = example_plan()
    assert ModelPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    path.write_text("old")
    plan.save(path)
    assert ModelPlan.load(path) == plan
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # temp file replaced it
    doc = json.loads(path.read_text())
    assert doc["layers"]["layers.0.mlp.fc2"] == {
        "forward": "iht",
        "dgrad": "oe_left",
        "wgrad": "bf16",
        "patterns": {"x": "col", "w": "none", "g": "row"},
    }


def test_plan_from_votes():
    votes = {"a": PatternVotes(), "b": PatternVotes()}
    for role, p in zip("xwg", ("col", "none", "row")):
        votes["a"].add(role, p)
        votes["b"].add(role, "none")
    plan = ModelPlan.from_votes(votes, "lv2")
    assert plan["a"] == plan_for_patterns("col", "none", "row", "lv2")
    assert plan["b"] == plan_for_patterns("none", "none", "none", "lv2")


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"version": 1, "layers": {', "bad JSON"),
        ("[1, 2]", "expected an object"),
        ('{"version": 7, "layers": {}}', "unsupported plan version 7"),
        (
            '{"version": 1, "layers": {"fc": {"forward": "fp8", "dgrad": "iht", "wgrad": "iht"}}}',
            "layer 'fc'.*'fp8'.*valid",
        ),
        ('{"version": 1, "layers": {"fc": {"forward": "iht"}}}', "layer 'fc'.*missing"),
        ('{"version": 1, "layers": {"fc": "iht"}}', "layer 'fc': expected an object"),
    ],
)
def test_corrupt_plans_get_clear_errors(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"plan.json: .*{match}"):
        ModelPlan.load(path)


def test_summary_lists_every_layer_and_gemm():
    lines = example_plan().summary().splitlines()
    assert lines[0].split() == ["layer", "x", "w", "g", "forward", "dgrad", "wgrad"]
    assert lines[2].split() == ["layers.0.mlp.fc2", "col", "none", "row", "iht", "oe_left", "bf16"]
    assert lines[3].split() == ["layers.1.mlp.fc1", "-", "-", "-", "bf16", "bf16", "bf16"]


# ---------------------------------------------------------------- a real tiny transformer

VOCAB, DIM, HEADS, SEQ, BATCH = 64, 64, 4, 32, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, DIM))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, DIM), nn.Parameter(0.02 * torch.randn(SEQ, DIM))
        self.blocks = nn.Sequential(Block(), Block())
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx) + self.pos)))


def markov_sequences(n: int, gen: torch.Generator) -> torch.Tensor:
    """Sequences from a random, peaked bigram chain: learnable structure in a few steps."""
    transition = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=gen), dim=-1)
    idx = torch.empty(n, SEQ + 1, dtype=torch.long)
    idx[:, 0] = torch.randint(VOCAB, (n,), generator=gen)
    for t in range(SEQ):
        idx[:, t + 1] = torch.multinomial(transition[idx[:, t]], 1, generator=gen).squeeze(1)
    return idx


def test_real_transformer_patterns_are_stable(one_thread):
    """Warm up 30 steps, then vote two 30-step windows: both decide the same patterns.

    (This tiny model changes fast: by step ~120 the attention-output row pattern fades.)
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = markov_sequences(64, gen)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    windows, recorders, losses = [], {}, []
    for step in range(90):
        if step in (30, 60):
            for r in recorders.values():
                r.remove()
            recorders = {name: PatternRecorder(m) for name, m in linears.items()}
            windows.append({name: r.votes for name, r in recorders.items()})
        batch = data[torch.randint(len(data), (BATCH,), generator=gen)]
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())

    assert sum(losses[-10:]) < 0.6 * sum(losses[:10])  # it did learn
    first, second = windows
    for name in linears:
        for role in "xwg":
            assert first[name].count(role) == second[name].count(role) == 30
            majority = second[name].majority(role)
            assert first[name].majority(role) == majority, (name, role, [w[name].counts(role) for w in windows])
            assert min(w[name].counts(role)[majority] for w in windows) > 15, (name, role)  # a real majority
    # Weights stay near their Gaussian init (no pattern); attention outputs and gradients have one.
    assert all(second[name].majority("w") == "none" for name in linears)
    assert any(second[name].majority(role) != "none" for name in linears for role in "xg")


def test_one_strategy_spelling_and_plans_in_the_papers_spelling_still_load():
    old = '{"version": 1, "layers": {"a": {"forward": "OE-left", "dgrad": "IHT", "wgrad": "BF16"}}}'
    plan = ModelPlan.from_json(old)
    assert plan["a"].to_dict() == {"forward": "oe_left", "dgrad": "iht", "wgrad": "bf16"}
    assert plan.summary().splitlines()[1].split()[-3:] == ["oe_left", "iht", "bf16"]  # as plan.json spells them


def test_a_copied_layer_calibrates_on_its_own():
    """``copy.deepcopy`` (and pickle) give a layer that votes and freezes by itself."""
    import copy

    from adahop import AdaHOPLinear

    layer = AdaHOPLinear(64, 32, recipe={"name": "adahop_lv2", "calibration_steps": 1})
    clone = copy.deepcopy(layer)
    clone(torch.randn(40, 64)).sum().backward()
    end_calibration_step(clone)
    assert not clone.calibrating and layer.calibrating
    layer(torch.randn(40, 64)).sum().backward()
    end_calibration_step(layer)
    assert not layer.calibrating
