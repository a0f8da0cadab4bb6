"""``adahop compare RUN_DIR...``: loss curves of several runs in one PNG, and their gap to BF16."""

from __future__ import annotations

import argparse
import json
import sys
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..atomic import save_figure, write_atomic
from .runs import RunRecord, read_run

SMOOTHING = 0.9  # EMA factor for the plotted train curves (raw curves drawn faintly)


def _ema(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Exponential moving average, bias-corrected (as TensorBoard does) so it does not lag at the start."""
    out, avg = [], 0.0
    for t, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**t))
    return out


def comparison_rows(runs: list[RunRecord]) -> list[dict]:
    """Final train/val loss of each run and its gap to the (first) bf16 run, if there is one."""
    base = next((r for r in runs if r.recipe == "bf16"), None)
    rows = []
    for r in runs:
        row = {
            "run": str(r.path),
            "recipe": r.recipe,
            "steps": r.train_steps[-1] if r.train_steps else 0,
            "final_train_loss": r.final_train_loss(),
            "final_val_loss": r.final_val_loss(),
        }
        if base is not None:
            row["train_gap_to_bf16"] = row["final_train_loss"] - base.final_train_loss()
            row["val_gap_to_bf16"] = row["final_val_loss"] - base.final_val_loss()
        rows.append(row)
    return rows


def plot_runs(runs: list[RunRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, r in enumerate(runs):
        color = f"C{i}"
        ax_train.plot(r.train_steps, r.train_loss, color=color, alpha=0.2, linewidth=0.8)
        ax_train.plot(r.train_steps, _ema(r.train_loss), color=color, label=r.label)
        if r.val_steps:
            ax_val.plot(r.val_steps, r.val_loss, "o-", color=color, markersize=3, label=r.label)
    ax_train.set(title=f"train loss (EMA {SMOOTHING})", xlabel="step", ylabel="loss")
    ax_val.set(title="validation loss", xlabel="step", ylabel="loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # Zoom the train panel on the second half, where the recipes separate.
    tails = [v for r in runs for v in _ema(r.train_loss)[len(r.train_loss) // 2 :]]
    if tails:
        lo, hi = min(tails), max(tails)
        pad = 0.5 * (hi - lo) + 1e-3
        ax_train.set_ylim(lo - pad, hi + 4 * pad)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def _fmt(v: float, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.4f}" if signed else f"{v:.4f}"


def markdown_table(rows: list[dict]) -> str:
    has_gap = any("train_gap_to_bf16" in r for r in rows)
    head = "| recipe | steps | final train loss | final val loss |"
    sep = "|---|---:|---:|---:|"
    if has_gap:
        head += " train gap to bf16 | val gap to bf16 |"
        sep += "---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = f"| {r['recipe']} | {r['steps']} | {_fmt(r['final_train_loss'])} | {_fmt(r['final_val_loss'])} |"
        if has_gap:
            line += f" {_fmt(r.get('train_gap_to_bf16'), True)} | {_fmt(r.get('val_gap_to_bf16'), True)} |"
        lines.append(line)
    return "\n".join(lines)


def print_table(rows: list[dict], console: Console) -> None:
    table = Table(title="final losses (train: mean of the last 10% of logged steps)")
    for col in ("recipe", "steps", "train loss", "val loss", "train gap", "val gap"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for r in rows:
        table.add_row(
            r["recipe"], str(r["steps"]), _fmt(r["final_train_loss"]), _fmt(r["final_val_loss"]),
            _fmt(r.get("train_gap_to_bf16"), True), _fmt(r.get("val_gap_to_bf16"), True),
        )
    console.print(table)


def compare(run_dirs: list[str | Path], out: str | Path) -> list[dict]:
    """Write ``<out>.png``, ``<out>.md`` and ``<out>.json``; returns the table rows."""
    runs = [read_run(d) for d in run_dirs]
    out = Path(out).with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(runs)
    plot_runs(runs, out.with_suffix(".png"))
    write_atomic(out.with_suffix(".md"), markdown_table(rows) + "\n")
    write_atomic(out.with_suffix(".json"), json.dumps(rows, indent=2) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop compare", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run directories written by 'adahop train'")
    parser.add_argument("--out", default="compare", help="output path stem (default: ./compare)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        rows = compare(args.runs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"adahop compare: error: {e}", file=sys.stderr)
        return 2
    print_table(rows, console)
    stem = Path(args.out).with_suffix("")
    console.print(f"wrote {stem}.png, {stem}.md, {stem}.json")
    return 0
