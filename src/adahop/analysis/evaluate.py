"""``adahop eval RUN_DIR_OR_CHECKPOINT --data SRC``: held-out loss and perplexity of a trained model.

The model is evaluated twice on the same batches: as trained (each layer's frozen plan in force)
and with every linear layer in BF16 (quantization-free inference). ``SRC`` is any ``--data``
value the trainer accepts, tokenized with the run's tokenizer; when it is the run's own training
source only its validation split is used, otherwise every token is held out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from ..atomic import write_atomic
from ..data import load_tokenizer, prepare_data, resolve_source, validation_batches
from ..data.dataset import load_tokens
from ..nn import adahop_layers
from ..policy.strategies import LayerPlan, Strategy

if TYPE_CHECKING:
    from ..train import TrainConfig


def held_out_tokens(cfg: TrainConfig, data: str) -> tuple[np.ndarray, str, str]:
    """(tokens, source name, which part) of ``data`` under the run's tokenizer: the validation
    split of the run's own training source, all of any other source."""
    train_source, source = resolve_source(cfg.data.source), resolve_source(data)
    if source.fingerprint() == train_source.fingerprint():
        tokens = prepare_data(source, cfg.data.vocab_size, cfg.data.val_fraction, progress=False)
        return tokens.val, source.name, "validation split"
    tokenizer = load_tokenizer(train_source, cfg.data.vocab_size, show_progress=False)
    return load_tokens(source, tokenizer, progress=False), source.name, "all"


def to_bf16(model: torch.nn.Module) -> None:
    """Put every converted linear layer of ``model`` in BF16 on all three GEMMs (in place)."""
    for layer in adahop_layers(model).values():
        layer.set_plan(LayerPlan.uniform(Strategy.BF16))


def _result(loss: float) -> dict[str, float]:
    return {"loss": loss, "perplexity": math.exp(loss)}


def evaluate(path: str | Path, data: str, max_batches: int | None = None, device: str = "auto") -> dict[str, Any]:
    """Held-out loss and perplexity of a run's latest checkpoint (or a checkpoint file) on
    ``data``, as trained and in BF16; returns the JSON-ready report."""
    from ..train import load_run, mean_loss, resolve_device

    dev = resolve_device(device)
    model, cfg, state = load_run(path, dev)
    tokens, name, part = held_out_tokens(cfg, data)
    batches = functools.partial(validation_batches, tokens, cfg.data.batch_size, cfg.data.seq_len, max_batches)
    trained = mean_loss(model, batches(), cfg, dev)
    to_bf16(model)
    bf16 = mean_loss(model, batches(), cfg, dev)
    n = sum(targets.numel() for _, targets in batches())
    return {
        "checkpoint": str(state["path"]),
        "step": state["step"],
        "recipe": cfg.recipe.name,
        "device": str(dev),  # "bf16" is float32 on the CPU, BF16 autocast on CUDA (training.autocast)
        "data": name,
        "part": part,
        "tokens": n,
        "as_trained": _result(trained),
        "bf16": _result(bf16),
        "loss_gap": trained - bf16,
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"{report['recipe']} step {report['step']} on {report['data']} "
        f"({report['part']}, {report['tokens']} tokens)"
    )
    for col in ("inference", "loss", "perplexity"):
        table.add_column(col, justify="left" if col == "inference" else "right")
    for key, label in (("as_trained", "as trained (plans)"), ("bf16", "every linear in BF16")):
        r = report[key]
        table.add_row(label, f"{r['loss']:.4f}", f"{r['perplexity']:.2f}")
    table.add_row("gap", f"{report['loss_gap']:+.4f}", "")
    console.print(table)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The run or checkpoint to read, how many held-out batches to score and where (``eval``, ``export``)."""
    parser.add_argument("path", help="a run directory (its latest checkpoint) or a checkpoint file")
    parser.add_argument("--max-batches", type=_positive, help="evaluate at most this many batches (default: all)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop eval", description=__doc__)
    add_checkpoint_arguments(parser)
    parser.add_argument("--data", required=True, help="text source: stdlib, file/dir/glob, or hf:NAME[:CONFIG]")
    parser.add_argument("--out", help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    from ..train import CheckpointError, ConfigError

    try:
        report = evaluate(args.path, args.data, args.max_batches, args.device)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"adahop eval: error: {e}", file=sys.stderr)
        return 2
    console = Console()
    print_report(report, console)
    if args.out:
        write_atomic(args.out, json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    return 0
