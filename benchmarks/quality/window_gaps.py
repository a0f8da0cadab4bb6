"""Train-loss differences between runs of one seed, averaged over windows of steps.

    python benchmarks/quality/window_gaps.py BASE RUN [RUN ...] [--windows 1-30,31-50,...]

Each RUN's logged train loss minus BASE's at the same steps, averaged per window, and the final
validation losses. Runs of one seed see the same batches, so the per-step difference cancels the
batch-to-batch spread that a single curve shows; what is left is the recipes' difference plus
the divergence of their trajectories (measure it with runs that differ only in
``training.rounding_seed_offset``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from adahop.train.metrics import read_metrics

DEFAULT_WINDOWS = "1-30,31-50,51-100,101-150,151-200,201-300,301-500,501-1000"


def losses(run: Path) -> tuple[dict[int, float], float | None]:
    """(train loss by step, last validation loss) of a run directory."""
    records = read_metrics(run)
    train = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    val = [r["loss"] for r in records if r["kind"] == "val"]
    return train, val[-1] if val else None


def window_means(run: dict[int, float], base: dict[int, float], windows: list[tuple[int, int]]) -> list[float | None]:
    """Mean of ``run - base`` over the steps both logged inside each window (None: no such step)."""
    means = []
    for lo, hi in windows:
        diffs = [run[s] - base[s] for s in run if lo <= s <= hi and s in base]
        means.append(statistics.mean(diffs) if diffs else None)
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--windows", default=DEFAULT_WINDOWS, help="comma-separated LO-HI step ranges")
    args = parser.parse_args()
    windows = [tuple(int(n) for n in w.split("-")) for w in args.windows.split(",")]
    base, base_val = losses(args.base)
    width = max(len(str(r)) for r in args.runs) + 3
    print(
        f"{'train loss minus ' + str(args.base):{width}s}"
        + "".join(f"{f'{lo}-{hi}':>10s}" for lo, hi in windows)
        + "  final val"
    )
    for run in args.runs:
        train, val = losses(run)
        cells = "".join(f"{m:+10.4f}" if m is not None else f"{'-':>10s}" for m in window_means(train, base, windows))
        gap = f"{val - base_val:+.4f}" if val is not None and base_val is not None else "-"
        print(f"{str(run):{width}s}{cells}  {gap}")


if __name__ == "__main__":
    main()
