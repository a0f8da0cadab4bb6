"""What changes with the number of ranks: the same global batches on 1, 2 and 4 CPU ranks (gloo).

Runs ``adahop train`` (``torchrun --standalone`` for several ranks) on a small model with
``data.batch_size`` the global batch, for a few recipes, and reports per recipe and rank count the
final train and validation loss, their difference from one process, and whether ``plan.json``
(the frozen plan) equals one process's. Recipes are chosen to take the differences apart:

- ``bf16``: only floating-point summation order differs (gradients reduced over ranks, matmuls of
  other shapes);
- ``mxfp4_hadamard`` with round-to-nearest dY: blocks along tokens align with each rank's share, so
  the same, through 4-bit rounding (an element near a rounding boundary can go either way);
- ``adahop_lv2`` with round-to-nearest dY: adds calibration (merged over ranks) and outlier
  extraction, whose top rows are picked within each rank's share;
- ``adahop_lv2`` as registered: adds stochastic rounding of dY, whose noise each rank draws from
  its own generator for its own share.

    python benchmarks/distributed/rank_count.py --out /tmp/rank_count   # ~5 min on 2 busy cores

Writes ``results.json`` and ``results.md`` in ``--out``; ``--reuse`` reads the runs already in ``--out``
instead of training them again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RECIPES = {
    "bf16": ["--recipe.name=bf16"],
    "mxfp4_hadamard, nearest dY": ["--recipe.name=mxfp4_hadamard", "--recipe.grad_rounding=nearest"],
    "adahop_lv2, nearest dY": ["--recipe.name=adahop_lv2", "--recipe.grad_rounding=nearest"],
    "adahop_lv2": ["--recipe.name=adahop_lv2"],
}
SMALL = [
    "--model.overrides.n_layers=2",
    "--model.overrides.dim=128",
    "--model.overrides.n_heads=4",
    "--model.overrides.n_kv_heads=2",
    "--data.seq_len=64",
    "--data.batch_size=8",
    "--data.vocab_size=2048",
    "--recipe.calibration_steps=10",
    "--logging.log_every=10",
    "--logging.val_every=1000",
    "--logging.val_batches=8",
    "--checkpoint.interval=1000",
]


def train(out: Path, ranks: int, recipe: list[str], steps: int, reuse: bool) -> dict:
    command = ["-m", "adahop", "train", "--config", "configs/tiny_cpu.toml", f"--out={out}", f"--steps={steps}"]
    command += SMALL + recipe
    if ranks > 1:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not (reuse and (out / "metrics.jsonl").exists()):
        subprocess.run([sys.executable, *command], check=True, env=env, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "train_losses": {r["step"]: r["loss"] for r in records if r["kind"] == "train"},
        "train_loss": [r["loss"] for r in records if r["kind"] == "train"][-1],
        "val_loss": [r["loss"] for r in records if r["kind"] == "val"][-1],
        "plan": json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reuse", action="store_true", help="read the runs already in --out")
    args = parser.parse_args()
    results = {}
    for label, recipe in RECIPES.items():
        for ranks in args.ranks:
            run = args.out / f"{label.replace(', ', '-').replace(' ', '_')}-{ranks}"
            results[f"{label} | {ranks}"] = train(run, ranks, recipe, args.steps, args.reuse)
            print(label, ranks, results[f"{label} | {ranks}"]["train_loss"], flush=True)
    lines = [
        f"Final losses after {args.steps} steps (global batch 8 x 64 tokens), against one process.",
        "",
        "| recipe | ranks | train loss | - 1 rank | val loss | - 1 rank | train loss - 1 rank, every logged step | plan as 1 rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in RECIPES:
        one = results[f"{label} | {args.ranks[0]}"]
        for ranks in args.ranks:
            r = results[f"{label} | {ranks}"]
            same = "-" if r["plan"] is None else ("yes" if r["plan"] == one["plan"] else "**no**")
            steps = ", ".join(f"{loss - one['train_losses'][step]:+.0e}" for step, loss in r["train_losses"].items())
            lines.append(
                f"| {label} | {ranks} | {r['train_loss']:.5f} | {r['train_loss'] - one['train_loss']:+.1e} "
                f"| {r['val_loss']:.5f} | {r['val_loss'] - one['val_loss']:+.1e} | {steps} | {same} |"
            )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
