"""``adahop export RUN_OR_CHECKPOINT --hf OUT``: an ``adahop train`` model as a plain ``transformers`` Llama.

OUT gets what ``LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read:
``config.json``, ``model.safetensors`` (float32, the trained weights), ``generation_config.json``
(generation stops at the run's end-of-document token) and the run's tokenizer; plus
``adahop_export.json``, the report: the held-out loss of the model as trained (each layer's frozen
plan in force) and of the exported plain model, on the run's own validation split.

Where every forward GEMM ran in BF16 (``bf16``, ``adahop_lv1_bf16_forward``, or a run stopped during
calibration), the exported model computes the trained forward: on the CPU in float32 its logits
equal adahop's bit for bit. Where the forward was quantized, the plain model is the trained weights
without the 4-bit forward; the report says how far that moves the loss.

The folder is written beside OUT under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..analysis.evaluate import add_checkpoint_arguments, held_out
from ..atomic import publish_dir, write_atomic
from ..models import Transformer
from ..models.llama import next_token_loss
from ..nn import adahop_layers
from ..policy.strategies import Strategy
from .transformers import hf_state_dict, llama_config

REPORT_FILE = "adahop_export.json"


class ExportError(ValueError):
    """Why a run cannot be exported (one line)."""


class _CausalLoss(nn.Module):
    """A ``transformers`` causal LM with ``Transformer``'s ``(tokens, targets) -> (logits, loss)``,
    so one loss loop (``train.mean_loss``) scores both models."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm(input_ids=tokens).logits
        return logits, next_token_loss(logits, targets)


def quantized_forward_layers(model: nn.Module) -> list[str]:
    """Converted layers whose frozen plan runs the forward GEMM in low precision."""
    return [
        name
        for name, layer in adahop_layers(model).items()
        if layer.plan is not None and layer.plan.forward is not Strategy.BF16
    ]


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder; name a new folder with --hf")


def to_llama(model: Transformer, eos_token_id: int, preset: str) -> nn.Module:
    """A ``LlamaForCausalLM`` holding ``model``'s weights (shared, not copied)."""
    from transformers import LlamaForCausalLM

    if type(model) is not Transformer:
        raise ExportError(f"model preset {preset!r} ({type(model).__name__}) has no Hugging Face equivalent")
    try:
        state = hf_state_dict(model.state_dict())
    except ValueError as e:
        raise ExportError(f"model preset {preset!r} has no Hugging Face equivalent: {e}") from None
    with torch.device("meta"):
        llama = LlamaForCausalLM(llama_config(model.args, eos_token_id))
    llama.load_state_dict(state, strict=True, assign=True)
    # Its one buffer, derived from the config, made where the weights are (not saved).
    rotary = llama.model.rotary_emb
    llama.model.rotary_emb = type(rotary)(llama.config).to(model.rope_cos.device)
    llama.tie_weights()
    return llama.eval()


def export_hf(
    path: str | Path, out: str | Path, max_batches: int | None = None, device: str = "auto"
) -> dict[str, Any]:
    """Write the run's latest checkpoint (or a checkpoint file) as a ``transformers`` Llama to
    ``out``; returns the report (also ``out/adahop_export.json``)."""
    from tokenizers import Tokenizer as BPE
    from transformers import PreTrainedTokenizerFast

    from ..data import load_tokenizer, resolve_source
    from ..data.tokenizer import EOS_TOKEN
    from ..train import load_run, mean_loss, resolve_device

    out = Path(out)
    check_out(out)
    dev = resolve_device(device)
    model, cfg, state = load_run(path, dev)
    tokenizer = load_tokenizer(resolve_source(cfg.data.source), cfg.data.vocab_size)
    llama = to_llama(model, tokenizer.eos_id, cfg.model.preset)

    held = held_out(cfg, max_batches=max_batches)
    quantized = quantized_forward_layers(model)
    trained = mean_loss(model, held.batches("as trained"), cfg, dev)
    exported = mean_loss(_CausalLoss(llama), held.batches("exported"), cfg, dev)
    report = {
        "checkpoint": str(state["path"]),
        "step": state["step"],
        "recipe": cfg.recipe.name,
        "model": cfg.model.preset,
        "forward": "quantized" if quantized else "bf16",
        "quantized_forward_layers": len(quantized),
        "device": str(dev),
        "data": held.name,
        "part": held.part,
        "tokens": held.num_tokens,
        "held_out_loss": {"as_trained": trained, "exported": exported},
        "loss_gap": exported - trained,
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier export killed midway
    tmp.mkdir()
    try:
        llama.save_pretrained(tmp)
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=BPE.from_str(tokenizer.to_json()), eos_token=EOS_TOKEN)
        hf_tokenizer.save_pretrained(tmp)
        write_atomic(tmp / REPORT_FILE, json.dumps(report, indent=2) + "\n")
        check_out(out)  # nothing appeared there meanwhile
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def describe(report: dict[str, Any], out: str) -> str:
    loss = report["held_out_loss"]
    lines = [
        f"exported {report['recipe']} step {report['step']} ({report['model']}) to {out}",
        f"held-out loss on {report['data']} ({report['part']}, {report['tokens']} tokens): "
        f"as trained {loss['as_trained']:.4f}, exported {loss['exported']:.4f} (gap {report['loss_gap']:+.4f})",
    ]
    if report["forward"] == "bf16":
        lines.append(
            "the trained forward ran in BF16: the exported model computes the same forward "
            "(bit for bit in float32 on the CPU; under CUDA autocast, to BF16 rounding)"
        )
    else:
        lines.append(
            f"{report['quantized_forward_layers']} layers ran a quantized forward: the exported model is their "
            "weights in full precision, without it"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop export", description=__doc__.split("\n\n")[0])
    add_checkpoint_arguments(parser)
    parser.add_argument("--hf", required=True, metavar="OUT", help="new folder for the transformers model")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('adahop export: error: needs transformers: pip install "adahop[transformers]"', file=sys.stderr)
        return 2
    from ..train import CheckpointError, ConfigError

    try:
        report = export_hf(args.path, args.hf, args.max_batches, args.device)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"adahop export: error: {e}", file=sys.stderr)
        return 2
    print(describe(report, args.hf))
    return 0
