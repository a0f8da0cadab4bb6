"""What bounds a step-bench run: its CUDA time split into GEMM, preparation, element-wise and the rest,
and the same step with the roofline's preparation kernels at (a multiple of) the fused design's floor.

    python benchmarks/step/bounds.py BENCH_JSON [BENCH_JSON ...]

Preparation is the quantize, fold and top-k / index kernel families: the roofline's kernels plus the
Inductor kernels that feed them (casts, slices, seeds), which the "at floor" rows keep as measured. The
fused floor is the roofline's ``one_read_floor_ms``: each source read once for both orientations, each
operand written once as E4M3, at the run's measured copy bandwidth. Speed ratios are CUDA-time ratios
to BF16 and float8 tensorwise of the same bench run (each in its fastest mode).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PREPARATION_FAMILIES = ("quantize", "fold", "top-k")
OTHER = "attention, other, optimizer, norm"  # every family but GEMM, preparation and element-wise
FLOOR_MULTIPLES = (1.5, 1.0)  # the target (1.5x its floor), and the floor itself


def _split(profile: dict) -> tuple[float, float, float, float]:
    """(GEMM, preparation, element-wise, rest) CUDA ms of one profiled step."""
    families = profile["families_ms"]
    gemm = families.get("GEMM", 0.0)
    preparation = sum(ms for name, ms in families.items() if name.startswith(PREPARATION_FAMILIES))
    elementwise = families.get("elementwise", 0.0)
    return gemm, preparation, elementwise, profile["cuda_ms"] - gemm - preparation - elementwise


def _best(runs: dict, recipe: str) -> dict | None:
    """The run of ``recipe`` in its fastest mode (the bench's order: compile+graph, then compile)."""
    for mode in ("compile+graph", "compile"):
        if (run := runs.get(f"{recipe}/{mode}")) is not None and "profile" in run:
            return run
    return None


def rows(case_key: str, runs: dict) -> list[str]:
    bf16, float8 = _best(runs, "bf16"), _best(runs, "float8_tensorwise")
    if bf16 is None or float8 is None:
        return [f"| {case_key} | (no BF16 or float8 tensorwise run: no ratios) |"]

    def row(label: str, gemm: float, preparation: float | None, elementwise: float, rest: float) -> str:
        step = gemm + (preparation or 0.0) + elementwise + rest
        prep = "-" if preparation is None else f"{preparation:.1f}"
        return (
            f"| {case_key} | {label} | {gemm:.1f} | {prep} | {elementwise:.1f} | {rest:.1f} | {step:.1f} | "
            f"{bf16['profile']['cuda_ms'] / step:.2f}x | {float8['profile']['cuda_ms'] / step:.2f}x |"
        )

    out = []
    for name, run in runs.items():
        recipe = name.split("/")[0]
        if run is not _best(runs, recipe):
            continue
        gemm, preparation, elementwise, rest = _split(run["profile"])
        roof = run.get("roofline")
        if roof is None:  # no adahop preparation: the BF16 path, the float8 peers (their casts are element-wise)
            out.append(row(recipe, gemm, None, elementwise, rest + preparation))
            continue
        out.append(row(recipe, gemm, preparation, elementwise, rest))
        glue = preparation - roof["total"]["ms"]
        for multiple in FLOOR_MULTIPLES:
            at = "at" if multiple == 1 else f"at {multiple:g}x"
            label = f"{recipe}, preparation kernels {at} their fused floor"
            out.append(row(label, gemm, glue + multiple * roof["total"]["one_read_floor_ms"], elementwise, rest))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="+", type=Path)
    args = parser.parse_args()
    print(f"| case | recipe (CUDA ms) | GEMM | preparation | element-wise | {OTHER} | step | vs BF16 | vs float8 tw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.bench_json:
        for case_key, case in json.loads(path.read_text())["step"]["cases"].items():
            print("\n".join(rows(case_key, case["runs"])))


if __name__ == "__main__":
    main()
