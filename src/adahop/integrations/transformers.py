"""adahop with Hugging Face ``transformers`` models.

``adahop.convert_model`` works on a ``transformers`` model as on any ``nn.Module`` (the LM head,
``lm_head``, stays ``nn.Linear``). ``AdaHOPLinear`` keeps ``nn.Linear``'s parameter keys and adds
one ``_extra_state`` tensor per layer; a plain ``save_pretrained`` keeps it and plain
``transformers`` loads such weights, reporting those keys as unexpected. :func:`save_pretrained`
writes clean weights instead, with the frozen plan beside them in ``adahop_plan.json``, and
:func:`from_pretrained` converts and freezes a model from such a folder.

The other way, an ``adahop train`` model (``adahop.models.Transformer``) is a ``LlamaForCausalLM``
under other names: :func:`llama_config` and :func:`hf_state_dict` translate it (``adahop export --hf``).
Both compute the same function: the rotary pairs (``i``, ``i + head_dim/2``), RMSNorm in float32 and
SwiGLU are the same in both, so on the CPU in float32 the logits are equal bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..models import ModelArgs
from ..nn.convert import adahop_layers, convert_model, model_plan
from ..policy.calibration import ModelPlan
from ..recipes import DEFAULT_RECIPE, Recipe

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel

PLAN_FILE = "adahop_plan.json"
_EXTRA_STATE = "._extra_state"


def save_pretrained(model: PreTrainedModel, path: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(path)`` with exactly the unconverted model's keys, plus the
    frozen plan in ``path/adahop_plan.json``. While any layer is still calibrating there is no
    complete plan, and an unconverted model has none: none is written (an older one is removed) and
    the loaded model calibrates again."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA_STATE)}
    model.save_pretrained(path, state_dict=state, **kwargs)
    plan_file = Path(path) / PLAN_FILE
    layers = adahop_layers(model).values()
    if not layers or any(layer.calibrating for layer in layers):  # an unconverted model has no plan either
        plan_file.unlink(missing_ok=True)
    else:
        model_plan(model).save(plan_file)


def from_pretrained(
    model_cls: type, path: str | Path, recipe: str | Recipe | dict = DEFAULT_RECIPE, **kwargs: Any
) -> PreTrainedModel:
    """``model_cls.from_pretrained(path)`` converted with ``recipe``, frozen from
    ``path/adahop_plan.json`` when the folder has one (otherwise it calibrates)."""
    model = model_cls.from_pretrained(path, **kwargs)
    plan_file = Path(path) / PLAN_FILE
    plan = ModelPlan.load(plan_file) if plan_file.exists() else None
    return convert_model(model, recipe, plan=plan)


# adahop ``Transformer`` parameter names -> ``LlamaForCausalLM``'s.
_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_IN_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_KEY = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


def llama_config(args: ModelArgs, eos_token_id: int | None = None) -> LlamaConfig:
    """The ``transformers`` ``LlamaConfig`` of an adahop model's ``ModelArgs`` (plain rotary
    embeddings of base ``rope_theta``, no biases, SwiGLU)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        hidden_act="silu",
        bos_token_id=None,  # adahop's data marks only the end of each document
        eos_token_id=eos_token_id,
        pad_token_id=None,
        dtype="float32",
    )


def hf_key(name: str) -> str:
    """The ``LlamaForCausalLM`` name of an adahop ``Transformer`` parameter; a ValueError for a
    name that has none (a model that is not the Llama ``adahop.models`` builds)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if name == "output.weight":
        return "lm_head.weight"
    m = _BLOCK_KEY.match(name)
    if m is None or m[2] not in _IN_BLOCK:
        raise ValueError(f"parameter {name!r} has no Hugging Face Llama equivalent")
    return f"model.layers.{m[1]}.{_IN_BLOCK[m[2]]}.weight"


def hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adahop ``Transformer`` state_dict under ``LlamaForCausalLM``'s names (each converted
    layer's ``_extra_state`` left out: the plain model has no plan)."""
    return {hf_key(k): v for k, v in state_dict.items() if not k.endswith(_EXTRA_STATE)}
