"""Summary of quality-study runs: final validation loss and ``adahop eval`` held-out loss per run,
and per recipe across seeds with the gap to BF16 (paired by seed where possible).

    python benchmarks/quality/summary.py OUT [OUT ...] [--json FILE] [--against LABEL] [--against LABEL2]

Each argument is an ``$OUT`` folder of ``benchmarks/quality/quality_h200.sh`` (its ``runs/*`` are read) or
one run directory. A run contributes its final validation loss (``metrics.jsonl``, the trainer's
validation split) and, when its ``eval.json`` is there, the held-out loss as trained and with every
linear in BF16. The gap statistics are those of ``adahop compare`` (``adahop.analysis.compare``):
paired by seed when every seed of the recipe has a BF16 run (standard error of the mean per-seed
gap, Student's t with n - 1 degrees of freedom), else Welch; "inside the noise" when |gap| < 2
standard errors or the t-test's two-sided p > 0.05 (t and p beside it); runs that share a seed
(rounding streams) count as one seed, their spread reported as the noise at a fixed seed.
``--against LABEL`` (a recipe label of the table, e.g. ``adahop_lv1``) adds each recipe's gap to
that recipe, by the same statistics: how an ablation moves its base recipe, paired by seed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from adahop.analysis.compare import (
    NOISE_SIGMAS,
    P_LIMIT,
    bf16_group,
    check_labels,
    gap_between,
    group_runs,
    seed_means,
    verdict_cell,
)
from adahop.analysis.runs import read_run
from adahop.atomic import write_atomic

BF16_SPREAD_TARGET = 0.01  # issue 12: a length where BF16's own seed spread is below this (nats)
EVAL_FILE = "eval.json"


def run_dirs(paths: list[str]) -> list[Path]:
    found = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            found.append(p)
        elif (p / "runs").is_dir():
            found += sorted(d for d in (p / "runs").iterdir() if (d / "metrics.jsonl").is_file())
        else:
            raise FileNotFoundError(f"{p}: neither a run directory nor a folder with runs/")
    return found


def _eval(path: Path) -> dict | None:
    f = path / EVAL_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def _configured_steps(path: Path) -> int | None:
    import tomllib

    f = path / "config.toml"
    return tomllib.loads(f.read_text()).get("training", {}).get("steps") if f.is_file() else None


def summarize(paths: list[str], against: list[str] | tuple[str, ...] = ()) -> dict:
    """Per run and per recipe (label); ``against``: labels to give every other recipe's gap to."""
    dirs = run_dirs(paths)
    runs = [read_run(d) for d in dirs]
    evals = {r.path: _eval(r.path) for r in runs}
    per_run = []
    for r in runs:
        e = evals[r.path]
        per_run.append(
            {
                "run": str(r.path),
                "recipe": r.group or r.recipe,
                "seed": r.seed,
                "steps": r.train_steps[-1] if r.train_steps else 0,
                "configured_steps": _configured_steps(r.path),
                "final_val_loss": r.final_val_loss(),
                "eval_loss": e["as_trained"]["loss"] if e else None,
                "eval_bf16_inference_loss": e["bf16"]["loss"] if e else None,
                "eval_tokens": e["tokens"] if e else None,
                "eval_part": e["part"] if e else None,
            }
        )
    val = lambda r: r.final_val_loss()  # noqa: E731
    ev = lambda r: evals[r.path]["as_trained"]["loss"] if evals[r.path] else None  # noqa: E731
    groups = group_runs(runs)
    check_labels(against, groups)
    base = bf16_group(groups)
    # (seed, value) of every run, by quantity (final validation loss, held-out eval loss) and recipe
    by_key = {
        key: {g: [(r.seed, value(r)) for r in group] for g, group in groups.items()}
        for key, value in (("val", val), ("eval", ev))
    }
    per_recipe = []
    for label, rs in groups.items():
        row = {
            "recipe": label,
            "base_recipe": rs[0].recipe,
            "n": len(rs),
            "seeds": sorted((r.seed for r in rs), key=str),
        }
        for key, samples in by_key.items():
            mine, same_seed_std = seed_means(samples[label])
            if not mine:
                continue
            values = list(mine.values())
            row[f"{key}_mean"] = statistics.fmean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
            row[f"{key}_same_seed_std"] = same_seed_std
            if base is not None and label != base and seed_means(samples[base])[0]:
                row[f"{key}_gap"] = gap_between(samples[label], samples[base])
            for other in against:
                if other != label and seed_means(samples[other])[0]:
                    row.setdefault("against", {}).setdefault(other, {})[key] = gap_between(
                        samples[label], samples[other]
                    )
        per_recipe.append(row)
    return {"runs": per_run, "recipes": per_recipe, "against": list(against)}


def _f(v, signed=False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.4f}" if signed else f"{v:.4f}"


def _gap_cell(g: dict | None) -> str:
    if not g:
        return "-"
    se = "" if g["stderr"] is None else f" ± {g['stderr']:.4f}"
    return f"{_f(g['gap'], True)}{se} {verdict_cell(g)}"


def markdown(summary: dict) -> str:
    lines = [
        "## Runs",
        "",
        "| run | recipe | seed | steps | final val loss | eval held-out (as trained) | eval held-out (all-BF16 inference) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["runs"]:
        steps = f"{r['steps']}" + (f"/{r['configured_steps']}" if r["configured_steps"] else "")
        lines.append(
            f"| {Path(r['run']).name} | {r['recipe']} | {r['seed']} | {steps} | {_f(r['final_val_loss'])} | "
            f"{_f(r['eval_loss'])} | {_f(r['eval_bf16_inference_loss'])} |"
        )
    lines += [
        "",
        f"## By recipe (mean ± std over seeds; gap to bf16 ± s.e., inside the noise: |gap| < {NOISE_SIGMAS:g} s.e. or p > {P_LIMIT:g})",
        "",
        "| recipe | n | seeds | val loss | val std at a seed | val gap to bf16 | eval loss | eval gap to bf16 |",
        "|---|---:|---|---:|---:|---|---:|---|",
    ]
    for r in summary["recipes"]:
        cells = []
        for key in ("val", "eval"):
            mean = r.get(f"{key}_mean")
            sd = r.get(f"{key}_std")
            cells.append(_f(mean) + ("" if sd is None else f" ± {sd:.4f}"))
            if key == "val":
                cells.append(_f(r.get("val_same_seed_std")))
            cells.append(_gap_cell(r.get(f"{key}_gap")))
        lines.append(f"| {r['recipe']} | {r['n']} | {','.join(map(str, r['seeds']))} | " + " | ".join(cells) + " |")
    for other in summary.get("against", []):
        lines += [
            "",
            f"## Against {other} (gap ± s.e., paired by seed where every seed has a run of {other})",
            "",
            f"| recipe | n | seeds | val gap to {other} | eval gap to {other} |",
            "|---|---:|---|---|---|",
        ]
        for r in summary["recipes"]:
            if other in r.get("against", {}):
                gaps = r["against"][other]
                lines.append(
                    f"| {r['recipe']} | {r['n']} | {','.join(map(str, r['seeds']))} | "
                    f"{_gap_cell(gaps.get('val'))} | {_gap_cell(gaps.get('eval'))} |"
                )
    bf16 = next((r for r in summary["recipes"] if r["base_recipe"] == "bf16"), None)
    if bf16 is not None:
        sd = bf16.get("val_std")
        if sd is None:
            lines += ["", "BF16 seed spread: one seed so far (no spread)."]
        else:
            ok = "below" if sd < BF16_SPREAD_TARGET else "NOT below"
            lines += [
                "",
                f"BF16 seed spread (std of the final val loss over {len(set(bf16['seeds']))} seeds): {sd:.4f}, {ok} "
                f"the issue's {BF16_SPREAD_TARGET} nats.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="$OUT folders of quality_h200.sh, or run directories")
    parser.add_argument("--json", help="also write the summary as JSON here")
    parser.add_argument(
        "--against", action="append", default=[], metavar="LABEL", help="also give every gap to this recipe"
    )
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.paths, against=args.against)
    except (FileNotFoundError, ValueError) as e:
        print(f"summary: error: {e}", file=sys.stderr)
        return 2
    if not summary["runs"]:
        print("summary: no finished runs found", file=sys.stderr)
        return 1
    print(markdown(summary), end="")
    if args.json:
        write_atomic(Path(args.json), json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
