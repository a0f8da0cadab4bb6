"""GPU A/B of issue #30's lever "one read, both orientations": X (forward L, wgrad R) and dY (dgrad L, wgrad L)
are each quantized twice from the same bf16 source on the fold_fp8 route; how much would one read save?

    PYTHONPATH=src python benchmarks/quantize/bothways/bothways_ab.py --out $OUT   # GPU, <= 150 s on an H100/H200
    PYTHONPATH=src python benchmarks/quantize/bothways/bothways_ab.py --dry-run    # CPU, interpreter, tiny shapes

Where training does it (``nn/linear.py``): the forward quantizes X row-wise straight into folded FP8
(``prepare_operand(x, ..., fold=True)`` -> ``ops.quantize_fold_2d`` -> ``quantize_fold_fp8``) and, a few lines on,
Xᵀ for wgrad column-wise (``prepare_operand(x.t(), ...)`` -> ``ops.quantize_2d(x, axis=0)`` ->
``quantize_mx_triton(axis=0)``: packed MXFP4, folded when wgrad runs); backward does the same to dY for dgrad
(folded rows, key ``dgrad_seed``) and wgrad (packed columns, key ``wgrad_seed``). Variants, per shape:

- ``split``: today, ``quantize_fold_fp8`` rows + ``quantize_mx_triton(axis=0)`` columns (two reads of the source);
- ``both``: ``quantize_mx_triton_both``, one read, rows packed (not folded), one key for both orientations;
- ``both+fold``: ``both`` then ``kernels.fold.fold_to_fp8`` of its rows: the split's outputs from one read of
  the source (plus a read of the packed rows);
- ``fused``: the prototype (``kernel.py``), folded rows and packed columns from one
  read, a key per orientation, bit for bit the split's outputs; ``fused w8``: the same with 256-wide chunks and
  8 warps a program, so half as many row strips wait in L2 between the two passes for the same warps per SM;
  ``fused staged``: the first pass also writes the rows as packed MXFP4 and the second folds those (a quarter
  of the bytes wait in L2, no second Hadamard; the scratch is written to DRAM in the end).

Checks first, on the device, bit for bit: ``both``'s rows and columns against ``quantize_mx_triton`` with axis 1
and 0 (stochastic rounding: the same key gives the same Philox stream at the same offsets), ``both+fold``'s
rows against ``quantize_fold_fp8``, ``fused`` against the split (every field: E4M3 bytes, row scales, lossy
counts, packed codes, E8M0 scales), on hard rows (NaN, Inf, zeros, subnormals, outliers, blocks far below their
row's largest) and on the full-size input. Then timings: each variant a CUDA graph of ``CALLS`` calls cycling
through enough input copies to exceed L2, replayed ``--repeats`` times, in the order A B C D D C B A; median
and range. Per step: the calls the lever would replace in a ``llama3_1b`` 8x2048 ``adahop_lv2`` step, counted
from the frozen plans of committed step benches (``fusion_calls``), times the saving per call.
``--out``: ``bothways_ab.json`` (rewritten after every stage) and ``bothways_ab.md``. A stage that would start
past ``--budget`` seconds is skipped and listed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

DRY = "--dry-run" in sys.argv or os.environ.get("DRY") == "1"
if DRY:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
QUANTIZE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(QUANTIZE))  # benchmarks/quantize: the bothways and epilogue packages

import torch  # noqa: E402

from adahop.atomic import write_atomic  # noqa: E402
from adahop.bench.common import copy_gb_per_s, environment, graph_seconds_per_launch  # noqa: E402
from adahop.kernels.fold import fold_to_fp8  # noqa: E402
from adahop.kernels.quantize import quantize_mx_triton, quantize_mx_triton_both  # noqa: E402
from adahop.kernels.quantize_fold import quantize_fold_fp8  # noqa: E402
from bothways.kernel import quantize_fold_rows_and_cols  # noqa: E402
from epilogue.inputs import hard_rows, same_bits  # noqa: E402

TOKENS = 8 * 2048  # llama3_1b at 8 x 2048
# (operand, row length): X [tokens, in] for the forward and wgrad, dY [tokens, out] for dgrad and wgrad. The
# first three are the shapes the decision needs (w1/w3/wq/wo's X, w1/w3's dY, wq/wo/w2's dY); then w2's X and
# wk/wv's dY, which complete the step's count.
CASES = (("X", 2048), ("dY", 8192), ("dY", 2048), ("X", 8192), ("dY", 512))
DRY_CASES = (("X", 64), ("dY", 32))  # one case per rounding: the plumbing (the kernels have their own tests)
DRY_TOKENS = 64  # two blocks of 32 down each column
ROUNDING = {"X": "nearest", "dY": "stochastic"}  # GemmConfig.act / .saved round to nearest, .grad stochastically
HADAMARD = 32  # every strategy of the lv2 plans but BF16 rotates (IHT, OE-left, OE-right)
L2_BYTES = 60 << 20  # a graph cycles through at least twice this much input (H100/H200: 50 MB)
CALLS = 12  # calls per graph replay
WIDE_BLOCK_N = 256  # "fused w8": 8 warps a program on CUDA
ROW_KEY, COL_KEY = 1234, 5678  # dY's dgrad and wgrad keys differ in training (draw_rounding_seeds)
# Committed step benches whose frozen adahop_lv2 plans give the calls per step (their "layers" lists).
PLANS = (
    ("H200 2026-12-05 levers n1", "benchmarks/step/2026-12-05-h200-levers/n1-1b-8x2048/bench.json"),
    ("H100 2026-12-05 issue30 n1", "benchmarks/step/2026-12-05-h100-issue30/n1-llama3_1b_8x2048/bench.json"),
)
PLAN_RUN = ("llama3_1b_8x2048", "adahop_lv2/compile+graph")  # recompute_wgrad_operands off: the lever applies
# Layers that read the same X (the attention and FFN norms' outputs): their equal quantize calls are one call
# under torch.compile (gemm.operand.prepare_operand passes no key to round to nearest).
SHARED_INPUT = {"wq": "attention", "wk": "attention", "wv": "attention", "w1": "ffn", "w3": "ffn"}
VARIANT_BYTES = {  # bytes read and written per element (E8M0 scales 1/32 a byte; row scales negligible)
    "split": 2 + 1 + 2 + 0.5 + 1 / 32,  # fold rows: read 2, write 1; columns: read 2, write 0.5 + scales
    "both": 2 + 2 * (0.5 + 1 / 32),
    "both+fold": 2 + 2 * (0.5 + 1 / 32) + (0.5 + 1 / 32) + 1,  # the fold reads the packed rows back
    "fused": 2 + 1 + 0.5 + 1 / 32,  # the second pass over a row strip reads it from L2
    "fused w8": 2 + 1 + 0.5 + 1 / 32,
    "fused staged": 2 + 1 + 2 * (0.5 + 1 / 32),  # the packed rows: written, read back from L2
}
TIMED = tuple(VARIANT_BYTES)  # split first: the savings are against it


def fusion_calls(layers: list[dict]) -> Counter:
    """Calls per step the lever replaces, by (operand, row length), in one step of a frozen plan: a layer's X
    when its forward folds (any strategy but BF16, in MXFP4, not ``forward_fmt``) and its wgrad quantizes Xᵀ (not BF16), one call
    for layers that share X with equal strategies; a layer's dY when its dgrad and wgrad both quantize it."""
    x_sites, dy = set(), Counter()
    for layer in layers:
        if layer["wgrad"].lower() == "bf16":
            continue
        block, leaf = layer["name"].rsplit(".", 1)
        if layer["forward"].lower() != "bf16" and not layer.get("forward_fmt"):  # row-wise FP8 does not fold
            group = SHARED_INPUT.get(leaf, leaf)
            x_sites.add((block.rsplit(".", 1)[0], group, layer["forward"], layer["wgrad"], layer["in_features"]))
        if layer["dgrad"].lower() != "bf16":
            dy["dY", layer["out_features"]] += 1
    return Counter(("X", site[-1]) for site in x_sites) + dy


def plan_calls(root: Path) -> dict[str, dict]:
    """``fusion_calls`` of each committed plan in ``PLANS`` (those missing from this tree are left out)."""
    preset, run = PLAN_RUN
    plans = {}
    for label, path in PLANS:
        if not (root / path).exists():
            continue
        runs = json.loads((root / path).read_text())["step"]["cases"][preset]["runs"]
        layers = runs.get(run, {}).get("layers")
        if layers:
            calls = fusion_calls(layers)
            plans[label] = dict(path=path, calls={f"{op} {n}": c for (op, n), c in sorted(calls.items())})
    return plans


class Case:
    """One operand at one shape: its inputs (copies beyond L2), the options of both orientations, the variants."""

    def __init__(self, operand: str, n: int, tokens: int, device: torch.device):
        self.operand, self.n, self.m = operand, n, tokens
        self.label = f"{operand} {tokens}x{n}"
        self.rounding = ROUNDING[operand]
        self.stochastic = self.rounding == "stochastic"
        gen = torch.Generator().manual_seed(n)
        copies = max(1, -(-2 * L2_BYTES // (2 * tokens * n))) if device.type == "cuda" else 1
        scale = 1e-3 if operand == "dY" else 1.0
        self.inputs = [
            (torch.randn(tokens, n, generator=gen) * scale).to(device, torch.bfloat16) for _ in range(copies)
        ]
        # device-side keys: a capture cannot copy a Python int to the GPU
        self.row_key = torch.tensor(ROW_KEY, dtype=torch.int64, device=device)
        self.col_key = torch.tensor(COL_KEY if self.stochastic else ROW_KEY, dtype=torch.int64, device=device)
        self.options = dict(scale_rule="floor", rounding=self.rounding, hadamard_block_size=HADAMARD)

    def rows(self, x, key=None, scores=False):
        return quantize_fold_fp8(x, seed=self.row_key if key is None else key, scores=scores, **self.options)

    def cols(self, x, key=None, scores=False):
        return quantize_mx_triton(x, axis=0, seed=self.col_key if key is None else key, scores=scores, **self.options)

    def split(self, x):
        return self.rows(x), self.cols(x)

    def both(self, x, key=None):
        return quantize_mx_triton_both(x, seed=self.row_key if key is None else key, **self.options)

    def both_fold(self, x, key=None):
        row, col = self.both(x, key)
        return fold_to_fp8(row), col

    def fused(self, x, **options):
        keys = dict(row_seed=self.row_key, col_seed=self.col_key)
        return quantize_fold_rows_and_cols(x, **keys, **self.options, **options)

    def variants(self) -> dict:
        fused_w8 = functools.partial(self.fused, block_n=WIDE_BLOCK_N if self.n >= WIDE_BLOCK_N else None)
        staged = functools.partial(self.fused, staged=True)
        return {"split": self.split, "both": self.both, "both+fold": self.both_fold, "fused": self.fused,
                "fused w8": fused_w8, "fused staged": staged}  # fmt: skip


def same_mx(a, b) -> dict[str, bool]:
    return {"codes": torch.equal(a.data.cpu(), b.data.cpu()), "scales": torch.equal(a.scales.cpu(), b.scales.cpu())}


def same_folded(a, b) -> dict[str, bool]:
    return {
        "e4m3": torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu()),
        "row_scale": torch.equal(a.row_scale.view(torch.int32).cpu(), b.row_scale.view(torch.int32).cpu()),
        "lossy": torch.equal(a.lossy_per_row.cpu(), b.lossy_per_row.cpu()),
    }


def check_case(case: Case, device: torch.device, scores: bool) -> list[dict]:
    """Every output that should match, bit for bit, on hard rows and the first full-size input; ``scores``: the
    prototype recording scores too (its own compilation, and the split's: once per operand, for time)."""
    inputs = {"hard rows": hard_rows(64, case.n, seed=case.n).to(device), "full size": case.inputs[0]}
    results = []
    for name, x in inputs.items():
        key = case.row_key
        want_rows = quantize_mx_triton(x, axis=1, seed=key, **case.options)
        want_cols = case.cols(x, key)  # one key: what ``both`` can take
        want_folded = case.rows(x, key)
        comparisons = {}
        try:
            row, col = case.both(x, key)
            comparisons["both rows = quantize_mx_triton(axis=1)"] = same_mx(row, want_rows)
            comparisons["both cols = quantize_mx_triton(axis=0)"] = same_mx(col, want_cols)
            comparisons["both+fold rows = quantize_fold_fp8"] = same_folded(case.both_fold(x, key)[0], want_folded)
            fused = case.fused(x)  # a key per orientation, as training draws them
            comparisons["fused rows = quantize_fold_fp8"] = same_folded(fused.folded, case.rows(x))
            comparisons["fused cols = quantize_mx_triton(axis=0)"] = same_mx(fused.cols, case.cols(x))
            wide = case.fused(x, block_n=min(WIDE_BLOCK_N, case.n))
            comparisons["fused w8 = fused"] = {
                **same_folded(wide.folded, fused.folded),
                **same_mx(wide.cols, fused.cols),
            }
            staged = case.fused(x, staged=True)
            comparisons["fused staged = fused, its packed rows = quantize_mx_triton(axis=1)"] = {
                **same_folded(staged.folded, fused.folded),
                **same_mx(staged.cols, fused.cols),
                **{f"packed {k}": v for k, v in same_mx(staged.packed_rows, want_rows).items()},
            }
            if scores:
                # OE-left's dgrad scores dY's rows, OE-right's wgrad scores Xᵀ's rows (X's columns)
                scored = case.fused(x, row_scores=True, col_scores=True)
                folded, row_scores = case.rows(x, scores=True)
                cols, col_scores = case.cols(x, scores=True)
                comparisons["fused with scores = split with scores"] = {
                    **same_folded(scored.folded, folded),
                    **same_mx(scored.cols, cols),
                    "row scores": same_bits(scored.row_scores, row_scores),
                    "col scores": same_bits(scored.col_scores, col_scores),
                }
        except Exception as error:  # recorded; the other checks and the timings still run
            comparisons["error"] = {repr(error)[:500]: False}
        for what, fields in comparisons.items():
            row = dict(case=case.label, rounding=case.rounding, input=name, check=what, fields=fields)
            row["exact"] = all(fields.values())
            print(f"check {row}", flush=True)
            results.append(row)
    return results


def time_case(case: Case, repeats: int, on_cuda: bool) -> dict:
    """Microseconds per call of every variant, run A B C .. C B A; bytes and the saving against the split."""
    calls = CALLS if on_cuda else 1
    variants = case.variants()
    launches = {
        name: [lambda f=f, x=case.inputs[i % len(case.inputs)]: f(x) for i in range(calls)]
        for name, f in variants.items()
    }
    times, failed = {name: [] for name in variants}, {}
    with torch.no_grad():
        for name in (*variants, *reversed(variants)):
            if name in failed:
                continue
            try:
                times[name] += graph_seconds_per_launch(launches[name], repeats, on_cuda)
            except Exception as error:  # recorded; the other variants are still timed
                failed[name] = repr(error)[:500]
                print(f"time {case.label} {name} failed: {failed[name]}", flush=True)
    row = dict(case=case.label, operand=case.operand, n=case.n, rounding=case.rounding, hadamard=HADAMARD)
    row.update({name: dict(error=error) for name, error in failed.items()})
    elements = case.m * case.n
    for name, ts in times.items():
        if name in failed:
            continue
        us = [t * 1e6 for t in ts]
        row[name] = dict(median_us=statistics.median(us), min_us=min(us), max_us=max(us))
        row[name]["bytes"] = VARIANT_BYTES[name] * elements
        row[name]["tb_per_s"] = row[name]["bytes"] / (row[name]["median_us"] * 1e-6) / 1e12
    for name in list(variants)[1:]:
        if "split" not in failed and name not in failed:
            row[name]["saving_us"] = row["split"]["median_us"] - row[name]["median_us"]
    print(f"time {row}", flush=True)
    return row


def per_step(timings: list[dict], plans: dict, copy_bandwidth: float | None = None) -> dict:
    """Per plan and variant: the saving per step (ms) over the timed shapes, the calls of untimed shapes, and
    (given the copy bandwidth, GB/s) the bound: one read of every call's bf16 source saved at copy bandwidth."""
    by_shape = {f"{r['operand']} {r['n']}": r for r in timings}
    totals = {}
    for label, plan in plans.items():
        entry = dict(calls=plan["calls"], untimed=[s for s in plan["calls"] if s not in by_shape], saving_ms={})
        if copy_bandwidth:
            source_bytes = sum(2 * TOKENS * int(s.split()[1]) * c for s, c in plan["calls"].items())
            entry["bound_ms"] = source_bytes / (copy_bandwidth * 1e9) * 1e3
        for variant in TIMED[1:]:
            savings = [r[variant]["saving_us"] * plan["calls"][s] for s, r in by_shape.items()
                       if "saving_us" in r.get(variant, {}) and s in plan["calls"]]  # fmt: skip
            if savings:
                entry["saving_ms"][variant] = sum(savings) / 1e3
        totals[label] = entry
    return totals


def us(v: dict) -> str:
    """Median [min, max] microseconds ("failed" for a variant that did not run, "-" for one not in this run)."""
    if "median_us" not in v:
        return "failed" if "error" in v else "-"
    return f"{v['median_us']:.1f} [{v['min_us']:.1f}, {v['max_us']:.1f}]"


def table(timings: list[dict], steps: dict) -> str:
    variants = [v for v in TIMED[1:] if timings and v in timings[0]]
    head = " | ".join(f"{v} us" for v in variants)
    saving = " / ".join(variants)
    lines = [
        f"| case | rounding, H | split us | {head} | saving per call us ({saving}) | split TB/s |",
        "|---|---|---:|" + "---:|" * len(variants) + "---:|---:|",
    ]
    for r in timings:
        cells = " | ".join(us(r.get(v, {})) for v in variants)
        savings = " / ".join(f"{r[v]['saving_us']:.1f}" if "saving_us" in r.get(v, {}) else "-" for v in variants)
        lines.append(
            f"| {r['case']} | {r['rounding']}, {r['hadamard']} | {us(r['split'])} | {cells} | {savings} | "
            f"{r['split'].get('tb_per_s', 0):.2f} |"
        )
    for label, entry in steps.items():
        calls = ", ".join(f"{s}: {c}" for s, c in entry["calls"].items())
        saved = ", ".join(f"{v} {ms:.2f} ms" for v, ms in entry["saving_ms"].items())
        untimed = f"; untimed shapes: {', '.join(entry['untimed'])}" if entry["untimed"] else ""
        bound = f"; bound (one read saved at copy bandwidth) {entry['bound_ms']:.2f} ms" if "bound_ms" in entry else ""
        lines.append(f"\n{label} (adahop_lv2 compile+graph): calls per step {{{calls}}}; saving per step: {saved}{untimed}{bound}")  # fmt: skip
    return "\n".join(lines)


def run(args) -> int:
    start = time.perf_counter()
    device = torch.device("cpu" if DRY else "cuda")
    info = dict(environment(), commit=os.environ.get("ADAHOP_COMMIT", ""))
    print(info, flush=True)
    out = Path(args.out) if args.out else None
    plans = plan_calls(QUANTIZE.parents[1])
    results = dict(info=info, plans=plans, checks=[], timings=[], per_step={}, skipped=[])
    repeats = 1 if DRY else args.repeats  # the interpreter's times mean nothing

    def save():
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / "bothways_ab.json", json.dumps(results, indent=1, default=str))

    checked_scores = set()
    for operand, n in DRY_CASES if DRY else CASES:
        if time.perf_counter() - start > args.budget:
            results["skipped"].append(f"{operand} {n}")
            print(f"skipped (past {args.budget} s): {operand} {n}", flush=True)
            continue
        case = Case(operand, n, DRY_TOKENS if DRY else TOKENS, device)
        results["checks"] += check_case(case, device, scores=operand not in checked_scores)
        checked_scores.add(operand)
        results["timings"].append(time_case(case, repeats, device.type == "cuda"))
        results["per_step"] = per_step(results["timings"], plans)
        save()
        del case
    if device.type == "cuda":  # what a step could save at most: one read of each source, at copy bandwidth
        results["copy_gb_per_s"] = copy_gb_per_s()
        results["per_step"] = per_step(results["timings"], plans, results["copy_gb_per_s"])
    return finish(results, out, time.perf_counter() - start)


def finish(results: dict, out: Path | None, seconds: float) -> int:
    """Print and write the verdict and the table; exit status 1 if any check failed."""
    passed = [c["exact"] for c in results["checks"]]
    results["bit_exact"] = all(passed)
    summary = table(results["timings"], results["per_step"])
    skipped = results["skipped"] or "nothing"
    print(
        f"\nbit-exact: {all(passed)} ({sum(passed)}/{len(passed)} checks)\n\n{summary}\n\n{seconds:.0f} s; skipped: {skipped}"
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "bothways_ab.json", json.dumps(results, indent=1, default=str))
        write_atomic(out / "bothways_ab.md", summary + "\n")
    return 0 if all(passed) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder for bothways_ab.json and bothways_ab.md (the device's $OUT)")
    parser.add_argument("--budget", type=float, default=90, help="no case starts after this many seconds")
    parser.add_argument("--repeats", type=int, default=10, help="timed graph replays per run (two runs per variant)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (or DRY=1)")
    args = parser.parse_args()
    if not (DRY or torch.cuda.is_available()):
        parser.error("no CUDA device: run with --dry-run (or DRY=1) on the CPU, in Triton's interpreter")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
