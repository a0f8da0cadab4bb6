"""``adahop eval RUN_DIR_OR_CHECKPOINT [--data SRC]``: held-out loss and perplexity of a trained model.

The model is evaluated twice on the same batches: as trained (each layer's frozen plan in force)
and with every linear layer in BF16 (quantization-free inference). ``SRC`` is any ``--data``
value the trainer accepts, tokenized with the run's tokenizer; when it is the run's own training
source (the default) only its validation split is used, otherwise every token is held out.
A progress bar per pass shows on a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm
from rich.console import Console
from rich.table import Table

from ..atomic import write_atomic
from .console import make_console
from ..data import load_tokenizer, prepare_data, resolve_source, validation_batches
from ..data.dataset import load_tokens
from ..data.loader import num_windows
from ..nn import adahop_layers
from ..policy.strategies import LayerPlan, Strategy

if TYPE_CHECKING:
    from ..train import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class HeldOut:
    """The held-out batches each model is scored on: the same windows in the same order every pass."""

    tokens: np.ndarray
    name: str  # of the source
    part: str  # "validation split" or "all"
    batch_size: int
    seq_len: int
    max_batches: int | None

    def batches(self, desc: str | None = None) -> Iterator[Batch]:
        """The batches; with ``desc``, behind a progress bar on a terminal (none in a log)."""
        batches = validation_batches(self.tokens, self.batch_size, self.seq_len, self.max_batches)
        if desc is None:
            return batches
        total = -(-num_windows(self.tokens, self.seq_len) // self.batch_size)
        total = total if self.max_batches is None else min(total, self.max_batches)
        return tqdm(batches, total=total, desc=desc, unit="batch", leave=False, disable=None)

    @property
    def num_tokens(self) -> int:
        return sum(targets.numel() for _, targets in self.batches())


def held_out(cfg: TrainConfig, data: str | None = None, max_batches: int | None = None) -> HeldOut:
    """The held-out batches of ``data`` under the run's tokenizer: the validation split of the run's
    own training source (``data`` None, or the same source), all of any other source."""
    train_source = resolve_source(cfg.data.source)
    source = train_source if data is None else resolve_source(data)
    d = cfg.data
    if source.fingerprint() == train_source.fingerprint():
        tokens = prepare_data(source, d.vocab_size, d.val_fraction, progress=False).val
        return HeldOut(tokens, source.name, "validation split", d.batch_size, d.seq_len, max_batches)
    tokenizer = load_tokenizer(train_source, d.vocab_size, show_progress=False)
    tokens = load_tokens(source, tokenizer, progress=False)
    return HeldOut(tokens, source.name, "all", d.batch_size, d.seq_len, max_batches)


def to_bf16(model: torch.nn.Module) -> None:
    """Put every converted linear layer of ``model`` in BF16 on all three GEMMs (in place)."""
    for layer in adahop_layers(model).values():
        layer.set_plan(LayerPlan.uniform(Strategy.BF16))


def _result(loss: float) -> dict[str, float]:
    return {"loss": loss, "perplexity": math.exp(loss)}


def evaluate(
    path: str | Path, data: str | None = None, max_batches: int | None = None, device: str = "auto"
) -> dict[str, Any]:
    """Held-out loss and perplexity of a run's latest checkpoint (or a checkpoint file) on
    ``data`` (default: the run's validation split), as trained and in BF16; returns the JSON-ready report."""
    from ..train import load_run, mean_loss, resolve_device

    dev = resolve_device(device)
    model, cfg, state = load_run(path, dev)
    held = held_out(cfg, data, max_batches)
    trained = mean_loss(model, held.batches("as trained"), cfg, dev)
    to_bf16(model)
    bf16 = mean_loss(model, held.batches("every linear in BF16"), cfg, dev)
    name, part, n = held.name, held.part, held.num_tokens
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
    parser.add_argument(
        "--data", help="text source: stdlib, file/dir/glob, or hf:NAME[:CONFIG] (default: the run's validation split)"
    )
    parser.add_argument("--out", help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    from ..train import CheckpointError, ConfigError

    try:
        report = evaluate(args.path, args.data, args.max_batches, args.device)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"adahop eval: error: {e}", file=sys.stderr)
        return 2
    console = make_console()
    print_report(report, console)
    if args.out:
        write_atomic(args.out, json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    return 0
