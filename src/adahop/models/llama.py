"""A Llama-3-style decoder-only transformer in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention`` (forward and backward run on CPU too) and a SwiGLU MLP.
Every projection except the LM head is a plain ``nn.Linear(bias=False)`` so that
``convert_model`` can swap it for a quantized layer; the LM head is named ``output`` and
is left in high precision by the converter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02
IGNORE_INDEX = -100  # target value that the loss skips


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [..., vocab] against ``targets`` [...], in fp32, skipping
    ``IGNORE_INDEX``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 8192
    ffn_hidden: int | None = None  # None: 8/3 * dim rounded up to a multiple of ``multiple_of``
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"ffn_hidden must be positive (or None), got {self.ffn_hidden}")
        if not (
            math.isfinite(self.norm_eps)
            and self.norm_eps > 0
            and math.isfinite(self.rope_theta)
            and self.rope_theta > 0
        ):
            raise ValueError(
                f"norm_eps and rope_theta must be finite and positive, got {self.norm_eps}, {self.rope_theta}"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        # SwiGLU has three matrices: 2/3 of the classic 4*dim keeps the parameter count.
        return self.multiple_of * math.ceil(8 * self.dim / 3 / self.multiple_of)


MODEL_PRESETS: dict[str, ModelArgs] = {
    # CPU default: ~7M parameters with the embedded corpus' 8k tokenizer.
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=8192, max_seq_len=256),
    # ~46M parameters with an 8k vocabulary.
    "small": ModelArgs(dim=512, n_layers=12, n_heads=8, n_kv_heads=4, vocab_size=8192, max_seq_len=512),
    # GPT-3 Small / Medium shapes; the names count parameters with a 32k vocabulary.
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32768, max_seq_len=2048),
    "350m": ModelArgs(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, vocab_size=32768, max_seq_len=2048),
    # Meta's shapes. Llama 3.2 1B and 3B tie the LM head to the embedding, Llama 3 8B does not.
    "llama3_1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    "llama3_3b": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=14336,
        max_seq_len=8192,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 so bf16 activations do not lose the mean-square.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [max_seq_len, head_dim // 2], in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) of x [batch, heads, seq, head_dim] by position."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, kv_heads, seq, d] -> [batch, kv_heads * n_rep, seq, d]; kv head j serves query
    heads j*n_rep ... (j+1)*n_rep - 1."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.recompute = False  # see Transformer.recompute

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.recompute or not torch.is_grad_enabled():
            return self._layers(x, cos, sin)
        # Checkpointed inside the block, so that when the block is an FSDP2 unit its hooks (parameter
        # all-gather, input cast) run around the checkpoint and the recompute sees the forward's inputs.
        return checkpoint(self._layers, x, cos, sin, use_reentrant=False)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_fn = next_token_loss  # compile_loss swaps in the compiled one
        # Derived from args, so not saved in checkpoints; filled by init_weights.
        table_shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) everywhere; the projections that write into the residual stream
        (wo, w2) are scaled by 1/sqrt(2 * n_layers) so its variance does not grow with depth.
        Also fills the rotary tables, so a model built on the meta device and materialized with
        ``to_empty`` is complete after one call."""
        args = self.args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        residual_std = INIT_STD / math.sqrt(2 * args.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, std=residual_std if is_residual_out else INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def compile_blocks(self, backend: str = "inductor", options: dict | None = None) -> None:
        """``torch.compile`` each transformer block in place (blocks share one graph where their layers
        run the same plans, as in torchtitan; ``adahop.nn.compiling``); ``Module.compile`` keeps the
        parameter names, so checkpoints are unaffected. ``options``: the backend's (``nn.compiling.compile_options``)."""
        for block in self.layers:
            block.compile(backend=backend, options=options or None)

    def compile_loss(self, backend: str = "inductor") -> None:
        """``torch.compile`` the loss (torchtitan's ``compile.components`` has it too): eager, the fp32
        cast, the log-softmax and their backward each write a [tokens, vocab] tensor, the largest of the
        step at a Llama 3 vocabulary; compiled, they fuse into reductions over the BF16 logits."""
        self.loss_fn = torch.compile(next_token_loss, backend=backend)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [batch, seq] -> logits [batch, seq, vocab], plus the mean next-token
        cross-entropy (computed in fp32) when ``targets`` is given."""
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return logits, self.loss_fn(logits, targets)

    @property
    def recompute(self) -> bool:
        """Activation checkpointing of every block: False keeps each block's activations for
        backward; True keeps only the blocks' inputs and recomputes the rest in backward
        (calibration votes in backward, once, so a recompute changes no vote)."""
        return bool(len(self.layers)) and self.layers[0].recompute

    @recompute.setter
    def recompute(self, on: bool) -> None:
        for block in self.layers:
            block.recompute = on


def get_model_args(name: str) -> ModelArgs:
    """A copy of the preset ``name``."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(MODEL_PRESETS)}")
    return dataclasses.replace(MODEL_PRESETS[name])


def build_model(preset: str, vocab_size: int | None = None, **overrides) -> Transformer:
    """Instantiate a preset, overriding any ``ModelArgs`` field (the vocabulary usually comes
    from the tokenizer). Build under ``torch.device("meta")`` to size a model without memory."""
    valid = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown ModelArgs fields {unknown}; valid fields: {', '.join(sorted(valid))}")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return Transformer(dataclasses.replace(get_model_args(preset), **overrides))


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameter count (shared tensors counted once); optionally without the input
    embedding, which is a lookup rather than a matmul."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding and isinstance(model, Transformer) and not model.args.tie_embeddings:
        n -= model.tok_embeddings.weight.numel()
    return n


def flops_per_token(model: Transformer, seq_len: int) -> int:
    """Training FLOPs per token: 6 per matmul parameter (forward + backward) plus the attention
    scores and weighted sum, 12 * layers * dim * seq_len (full score matrix, as in PaLM's MFU)."""
    args = model.args
    return 6 * num_params(model, exclude_embedding=True) + 12 * args.n_layers * args.dim * seq_len
