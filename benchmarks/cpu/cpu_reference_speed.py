r"""Tokens/s of the CPU quickstart: ``bf16`` against ``adahop_lv2`` after its plans freeze.

Runs ``adahop train`` (tiny preset, CPU, the quickstart config) in fresh processes, alternating
the recipes so that a noisy shared machine slows both alike, and reads ``tokens_per_s`` of the
logged windows from each run's ``metrics.jsonl`` (train steps only: no evaluation, no saving).
The first window of each phase is dropped as warm-up. The adaptive recipe calibrates in high
precision for ``recipe.calibration_steps`` (30) steps and then runs the frozen MXFP4 plan, which
on CPU is the pure-PyTorch reference path.

    PYTHONPATH=src python benchmarks/cpu/cpu_reference_speed.py [--rounds 3] [--frozen-steps 30] \
        [--threads 1] [--out FILE.json]

The package imported is whatever ``PYTHONPATH`` selects, so the same script times an older
checkout (``git archive <commit> src | tar -x -C /tmp/old`` and ``PYTHONPATH=/tmp/old/src``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALIBRATION_STEPS = 30  # adahop_lv2's recipe.calibration_steps
LOG_EVERY = 5


def train_windows(recipe: str, steps: int, out: Path, threads: int | None) -> dict[str, list[float]]:
    """tokens/s of every logged window of one fresh ``adahop train`` run, by phase."""
    cmd = [
        sys.executable,
        "-m",
        "adahop.cli",
        "train",
        "--recipe",
        recipe,
        "--steps",
        str(steps),
        "--out",
        str(out),
        f"--logging.log_every={LOG_EVERY}",
        f"--logging.val_every={10 * steps}",
        f"--checkpoint.interval={10 * steps}",
    ]
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    windows: dict[str, list[float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            windows.setdefault(rec["phase"], []).append(rec["tokens_per_s"])
    return windows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="bf16 / adahop_lv2 pairs, alternated")
    parser.add_argument("--frozen-steps", type=int, default=30, help="steps timed after the freeze (and for bf16)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's choice); 1 is far less "
        "sensitive to other processes on the same cores",
    )
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    import adahop  # the package PYTHONPATH selects

    per_round = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            row = {}
            runs = (("bf16", args.frozen_steps + LOG_EVERY), ("adahop_lv2", CALIBRATION_STEPS + args.frozen_steps))
            for recipe, steps in runs:
                start = time.perf_counter()
                windows = train_windows(recipe, steps, Path(tmp) / f"{recipe}-{r}", args.threads)
                for phase, values in windows.items():
                    row[f"{recipe}/{phase}"] = statistics.median(values[1:] or values)
                row[f"{recipe}/wall_s"] = time.perf_counter() - start
            row["loadavg_1min"] = os.getloadavg()[0]  # other users of the same cores
            per_round.append(row)
            print(f"round {r + 1}: " + "  ".join(f"{k} {v:,.0f}" for k, v in row.items()), flush=True)

    keys = per_round[0].keys()
    median = {k: statistics.median(row[k] for row in per_round) for k in keys}
    ratios = [row["adahop_lv2/frozen"] / row["bf16/frozen"] for row in per_round]
    result = {
        "adahop": adahop.__file__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "rounds": per_round,
        "median": median,
        "frozen_over_bf16": {"median": statistics.median(ratios), "per_round": ratios},
    }
    print(
        f"median tokens/s: bf16 {median['bf16/frozen']:,.0f}, adahop_lv2 calibrating "
        f"{median['adahop_lv2/calibrating']:,.0f}, frozen {median['adahop_lv2/frozen']:,.0f} "
        f"({statistics.median(ratios):.2f} of bf16; per round {', '.join(f'{x:.2f}' for x in ratios)})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
