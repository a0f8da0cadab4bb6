"""``adahop analyze RUN_DIR_OR_CHECKPOINT``: per-layer outlier report of a trained model.

Loads the checkpoint, runs one held-out batch forward and backward, and for every linear layer
reports the pattern of X, W and dY with the statistic behind it, the MXFP4 error of each tensor
with and without the inner Hadamard transform, and the strategy each GEMM got. Writes
``report.md``, ``report.json``, ``overview.png`` and ``heatmaps/<layer>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ..atomic import write_atomic
from .console import make_console
from .heatmaps import plot_layer, plot_overview
from ..policy.strategies import ROLES
from .outliers import LayerReport, analyze_model

ANALYSIS_SEED = 0


def _cell(rep: LayerReport, role: str) -> str:
    t = rep.tensors.get(role)
    return "-" if t is None else f"{t.pattern} {t.row_score:.1f}/{t.col_score:.1f}"


def _gemms(rep: LayerReport) -> list[str]:
    s = rep.strategies
    return ["nn.Linear"] * 3 if s is None else [s["forward"], s["dgrad"], s["wgrad"]]


def markdown_report(reports: list[LayerReport], source: str) -> str:
    lines = [
        f"# Outlier report: {source}",
        "",
        "Pattern (row score / col score) of each tensor in storage layout; MXFP4 relative error "
        "along the GEMM contraction dim, plain -> with inner Hadamard; strategy per GEMM.",
        "",
        "| layer | X | W | dY | X err | W err | dY err | forward | dgrad | wgrad |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rep in reports:
        errs = [
            f"{t.mxfp4_rel_error:.3f} -> {t.iht_rel_error:.3f}" if (t := rep.tensors.get(r)) else "-" for r in ROLES
        ]
        cells = [rep.name, *(_cell(rep, r) for r in ROLES), *errs, *_gemms(rep)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def print_report(reports: list[LayerReport], console: Console) -> None:
    table = Table(title="outlier pattern (row/col score) of each tensor, and each GEMM's strategy")
    for col in ("layer", "X", "W", "dY", "forward", "dgrad", "wgrad"):
        table.add_column(col, no_wrap=True)
    for rep in reports:
        table.add_row(rep.name, *(_cell(rep, r) for r in ROLES), *_gemms(rep))
    console.print(table)


def load_trained_model(path: str | Path, sequences: int | None = None):
    """(model, held-out batch, checkpoint path) for a run directory or a checkpoint file; the batch
    is the first validation batch, or its first ``sequences`` rows."""
    from ..train import build_data, load_run

    model, cfg, state = load_run(path)
    inputs, targets = next(iter(build_data(cfg, progress=False).val))
    return model, (inputs[:sequences], targets[:sequences]), state["path"]


def report_model(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> list[LayerReport]:
    """``analyze_model`` on one batch, the same every time: the backward draws stochastic-rounding
    seeds from torch's generator, seeded here with ``ANALYSIS_SEED`` (the caller's state is kept)."""
    with torch.random.fork_rng():
        torch.manual_seed(ANALYSIS_SEED)
        return analyze_model(model, lambda m: m(inputs, targets)[1])


def analyze(
    path: str | Path, out: str | Path | None = None, *, heatmaps: bool = True, sequences: int | None = None
) -> tuple[list[LayerReport], Path]:
    """Write the report of a run's latest checkpoint (or of a checkpoint file) to ``out``;
    ``heatmaps=False`` leaves out the per-layer figures (one file per layer); ``sequences``: measure
    on the first that many sequences of the validation batch (the CPU reference is slow on big batches)."""
    model, (inputs, targets), checkpoint = load_trained_model(path, sequences)
    reports = report_model(model, inputs, targets)
    out = Path(out) if out else checkpoint.parent.parent / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.md", markdown_report(reports, str(checkpoint)))
    write_atomic(out / "report.json", json.dumps([r.to_dict() for r in reports], indent=2) + "\n")
    plot_overview(reports, out / "overview.png")
    if heatmaps:
        (out / "heatmaps").mkdir(exist_ok=True)
        for rep in reports:
            plot_layer(rep, out / "heatmaps" / f"{rep.name}.png")
    return reports, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop analyze", description=__doc__)
    parser.add_argument("path", help="a run directory (its latest checkpoint) or a checkpoint file")
    parser.add_argument("--out", help="output directory (default: <run>/analysis)")
    parser.add_argument("--no-heatmaps", action="store_true", help="skip heatmaps/<layer>.png (one figure per layer)")
    parser.add_argument(
        "--sequences",
        type=int,
        metavar="N",
        help="measure on the first N sequences of the validation batch (default: all)",
    )
    args = parser.parse_args(argv)
    if args.sequences is not None and args.sequences < 1:
        parser.error(f"--sequences must be at least 1, got {args.sequences}")
    console = make_console()
    from ..train import CheckpointError, ConfigError

    try:
        reports, out = analyze(args.path, args.out, heatmaps=not args.no_heatmaps, sequences=args.sequences)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"adahop analyze: error: {e}", file=sys.stderr)
        return 2
    print_report(reports, console)
    figures = "" if args.no_heatmaps else " and heatmaps/"
    console.print(f"wrote {out}/report.md, report.json, overview.png{figures} ({len(reports)} layers)")
    return 0
