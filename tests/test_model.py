import math

import pytest
import torch

from adahop.models import (
    MODEL_PRESETS,
    ModelArgs,
    Transformer,
    build_model,
    flops_per_token,
    get_model_args,
    num_params,
)
from adahop.models.llama import IGNORE_INDEX, next_token_loss

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(**{**SMALL, **overrides}))


def test_shapes_and_loss_matches_cross_entropy():
    model = make_model()
    tokens = torch.randint(0, 97, (3, 16))
    targets = torch.randint(0, 97, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 97)
    logits2, loss = model(tokens, targets)
    torch.testing.assert_close(logits2, logits)
    # Independent reference: float64 log-softmax, mean negative log-likelihood.
    logp = torch.log_softmax(logits.double(), dim=-1)
    expected = -logp.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_compiled_loss_matches_the_eager_loss_and_gradient():
    """``compile_loss`` (the trainer's compile mode) changes how the loss runs, not what it computes:
    the same loss and the same BF16 gradient of the logits as eager, ignored targets included."""
    model = make_model()
    tokens = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(2))
    targets[0, :5] = IGNORE_INDEX

    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        logits.retain_grad()
        loss = model.loss_fn(logits, targets)
        loss.backward()
        return loss.detach(), logits.grad

    eager = loss_and_grad()
    model.compile_loss()
    compiled = loss_and_grad()
    assert model.loss_fn is not next_token_loss
    torch.testing.assert_close(compiled, eager)


def test_initial_loss_is_near_uniform():
    model = make_model()
    _, loss = model(torch.randint(0, 97, (4, 32)), torch.randint(0, 97, (4, 32)))
    assert abs(loss.item() - math.log(97)) < 0.1


def test_causal_masking():
    model = make_model()
    tokens = torch.randint(0, 97, (2, 20))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 97
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        make_model()(torch.zeros(1, 33, dtype=torch.long))


def test_gqa_matches_multi_head_with_repeated_kv():
    """A GQA model equals a plain multi-head model whose k/v heads are copies: kv head j serves
    query heads j*rep ... (j+1)*rep - 1."""
    gqa = make_model(n_kv_heads=2)
    mha = make_model(n_kv_heads=4)
    state = gqa.state_dict()
    head_dim, rep = 64 // 4, 2
    for key, value in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = value.view(2, head_dim, 64)
            state[key] = heads.repeat_interleave(rep, dim=0).reshape(4 * head_dim, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_attention_matches_explicit_float64_reference():
    """One attention layer against softmax(q k^T / sqrt(d) + causal mask) v written out in float64,
    with rotary embeddings as complex multiplication."""
    model = make_model(n_kv_heads=4).double()
    attn = model.layers[0].attention
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    b, t, h, d = 2, 10, 4, 16
    q = attn.wq(x).view(b, t, h, d)
    k = attn.wk(x).view(b, t, h, d)
    v = attn.wv(x).view(b, t, h, d)
    # RoPE pairs element i with i + d/2, rotated by angle pos * theta^(-2i/d).
    freqs = 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(t, d // 2, dtype=torch.float64), torch.arange(t)[:, None] * freqs)

    def rope(z):
        zc = torch.complex(z[..., : d // 2], z[..., d // 2 :]) * rot[:, None]
        return torch.cat((zc.real, zc.imag), dim=-1)

    q, k = rope(q), rope(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, h * d)
    expected = attn.wo(out)
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_loss_decreases_on_a_fixed_batch():
    model = make_model()
    tokens = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        _, loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_meta_build_then_to_empty_and_init_weights():
    with torch.device("meta"):
        model = build_model("tiny", **SMALL)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = make_model()
    torch.testing.assert_close(model.rope_cos, reference.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin, rtol=0, atol=0)
    _, loss = model(torch.randint(0, 97, (2, 32)), torch.randint(0, 97, (2, 32)))
    assert abs(loss.item() - math.log(97)) < 0.1


def test_rope_buffers_are_not_saved():
    assert not any(key.startswith("rope_") for key in make_model().state_dict())


def test_tied_embeddings_share_the_weight():
    model = make_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    untied = make_model()
    assert num_params(untied) - num_params(model) == 97 * 64


def test_residual_projections_get_scaled_init():
    model = make_model(dim=256, n_heads=4, n_kv_heads=4, n_layers=8)
    layer = model.layers[0]
    assert abs(layer.attention.wq.weight.std().item() - 0.02) < 0.002
    assert abs(layer.attention.wo.weight.std().item() - 0.02 / 4) < 0.0005
    assert abs(layer.feed_forward.w2.weight.std().item() - 0.02 / 4) < 0.0005


def count_llama(args: ModelArgs) -> int:
    """Parameter count written out from the architecture, independent of the module tree."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attention = 2 * d * d + 2 * d * kv
    mlp = 3 * d * args.hidden_dim
    embeddings = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return args.n_layers * (attention + mlp + 2 * d) + d + embeddings


# Meta's published sizes for Llama 3.2 1B / 3B and Llama 3 8B.
PUBLISHED = {"llama3_1b": 1_235_814_400, "llama3_3b": 3_212_749_824, "llama3_8b": 8_030_261_248}
NOMINAL = {"tiny": 7e6, "small": 50e6, "125m": 125e6, "350m": 350e6}


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_preset_parameter_counts(name):
    with torch.device("meta"):
        model = build_model(name)
    n = num_params(model)
    assert n == count_llama(model.args)
    if name in PUBLISHED:
        assert n == PUBLISHED[name]
    else:
        assert 0.85 < n / NOMINAL[name] < 1.15


def test_llama_preset_shapes():
    args = get_model_args("llama3_1b")
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (2048, 16, 32, 8)
    assert (args.hidden_dim, args.vocab_size, args.rope_theta) == (8192, 128256, 500000.0)
    assert get_model_args("llama3_8b").hidden_dim == 14336


def test_tiny_is_the_default_shape():
    args = get_model_args("tiny")
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.max_seq_len) == (
        256,
        4,
        4,
        2,
        256,
    )


def test_build_model_overrides():
    with torch.device("meta"):
        model = build_model("tiny", vocab_size=1000, n_layers=2)
    assert model.args.vocab_size == 1000 and len(model.layers) == 2
    assert model.output.weight.shape == (1000, 256)
    assert MODEL_PRESETS["tiny"].vocab_size == 8192  # presets are not mutated


def test_unknown_preset_and_field_errors_list_valid_choices():
    with pytest.raises(ValueError, match="valid presets: tiny, small, 125m"):
        get_model_args("huge")
    with pytest.raises(ValueError, match="valid fields:.*n_layers"):
        build_model("tiny", layers=3)


def test_invalid_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        ModelArgs(dim=100, n_heads=3, n_kv_heads=1)


def test_flops_per_token():
    with torch.device("meta"):
        model = build_model("llama3_8b")
    args = model.args
    matmul_params = num_params(model) - args.vocab_size * args.dim  # embedding lookup is free
    assert flops_per_token(model, 4096) == 6 * matmul_params + 12 * 32 * 4096 * 4096
    with torch.device("meta"):
        tied = build_model("llama3_1b")
    # A tied LM head is still a matmul: its shared weight counts.
    assert flops_per_token(tied, 1) == 6 * num_params(tied) + 12 * 16 * 2048


def test_bf16_autocast_forward_and_backward():
    model = make_model()
    tokens = torch.randint(0, 97, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(tokens, tokens)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
