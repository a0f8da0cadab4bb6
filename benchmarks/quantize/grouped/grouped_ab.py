"""GPU A/B of issue #30's "fewer launches" lever: W's forward operands of every linear layer quantized by a
``quantize_fold_fp8`` launch per weight, against one grouped launch (``launcher.py``), at the step's shapes.

    PYTHONPATH=src python benchmarks/quantize/grouped/grouped_ab.py --out $OUT    # GPU, one call, timeout_s 200
    PYTHONPATH=src python benchmarks/quantize/grouped/grouped_ab.py --dry-run     # CPU, interpreter, tiny shapes

Weights: every converted linear layer of ``llama3_1b`` (112) and ``llama3_3b`` (196), shapes read from the model
(``shapes.py``), bf16 values of the model's initialization scale. They quantize as ``GemmConfig.act`` does W for
the forward GEMM: round to nearest, scale rule floor, the 32-point Hadamard (IHT and OE layers) or none (MXFP4
layers). First the checks: on hard rows of mixed shapes (NaN, Inf, zeros, subnormals, the fold's exact path) and
on the full weight lists, every grouped output against its own ``quantize_fold_fp8`` launch, bit for bit in
every field, one program per item and on a persistent grid. Then the timings: each variant is one CUDA graph
(the per-tensor launches, or one grouped launch) replayed ``--repeats`` times under CUDA events, in the order
per-tensor, grouped, persistent, grouped at 96 registers, then reversed; median and range over both runs, in
milliseconds per set of weights (what one optimizer step quantizes in this orientation). A stage that would
start past ``--budget`` seconds is skipped and listed. ``--out``: ``grouped_ab.json`` (rewritten after every
stage) and ``grouped_ab.md``. Exit status 1 if any check is not bit-exact.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv or os.environ.get("DRY") == "1"
if DRY:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/quantize: the grouped package

import torch  # noqa: E402
import triton  # noqa: E402

from adahop.atomic import write_atomic  # noqa: E402
from adahop.bench.common import graph_seconds_per_launch  # noqa: E402
from adahop.kernels.quantize_fold import quantize_fold_fp8  # noqa: E402
from adahop.models.llama import INIT_STD  # noqa: E402
from grouped.inputs import mixed_hard_tensors, same_fold  # noqa: E402
from grouped.launcher import WIDE_REGISTERS, plan_grouped_fold  # noqa: E402
from grouped.shapes import linear_weight_shapes  # noqa: E402

PRESETS = {"llama3_1b": {}, "llama3_3b": {}}
# One layer of a small model: rows of 64 and 96 elements (a partial block tile), several programs a tensor.
DRY_PRESETS = {"llama3_1b (dry)": dict(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=96)}
HADAMARDS = (32, 0)  # the decision's case first: IHT and OE layers
PROGRAMS_PER_SM = 3  # the persistent grid: at 80 registers, three programs of 8 warps fit an SM
COPY_TB_PER_S = 4.22  # the H200's measured copy bandwidth (benchmarks/quantize/README.md)
SEED = 1234


def weights(preset: str, overrides: dict, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device).manual_seed(SEED)
    shapes = [shape for _, shape in linear_weight_shapes(preset.split()[0], **overrides)]
    return [(torch.randn(s, generator=gen, device=device) * INIT_STD).to(torch.bfloat16) for s in shapes]


def checks_of(name: str, tensors: list[torch.Tensor], plan, hb: int) -> dict:
    """Every output of ``plan`` (already launched, Hadamard ``hb``) against its own ``quantize_fold_fp8`` launch."""
    failed = {}
    for i, x in enumerate(tensors):
        fields = same_fold(plan.outputs[i], quantize_fold_fp8(x, hadamard_block_size=hb))
        if not all(fields.values()):
            failed[f"{i} {tuple(x.shape)}"] = fields
    return dict(name=name, tensors=len(tensors), items=plan.items, exact=not failed, failed=failed)


def persistent_programs(device: torch.device) -> int:
    return (
        PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    )


def stage(preset: str, overrides: dict, hb: int, device: torch.device, repeats: int) -> tuple[list, dict]:
    """Checks and timings of one weight list at one Hadamard setting."""
    tensors = weights(preset, overrides, device)
    start = time.perf_counter()  # the host's table building: once per weight list in training, if integrated
    plans = {
        "grouped": plan_grouped_fold(tensors, hadamard_block_size=hb),
        "persistent": plan_grouped_fold(tensors, hadamard_block_size=hb, programs=persistent_programs(device)),
        f"grouped {WIDE_REGISTERS} reg": plan_grouped_fold(
            tensors, hadamard_block_size=hb, max_registers=WIDE_REGISTERS
        ),
    }
    plan_seconds = (time.perf_counter() - start) / len(plans)
    checks = []
    for name, plan in plans.items():
        plan.launch()
        checks.append(checks_of(f"{preset} H{hb} {name}", tensors, plan, hb))
    variants = {
        "per-tensor": [functools.partial(quantize_fold_fp8, x, hadamard_block_size=hb) for x in tensors],
        **{name: [plan.launch] for name, plan in plans.items()},
    }
    ms = {name: [] for name in variants}
    order = tuple(variants) if DRY else (*variants, *reversed(variants))  # A B C D D C B A on the GPU
    for name in order:
        per_launch = graph_seconds_per_launch(variants[name], repeats, device.type == "cuda")
        ms[name] += [1e3 * s * len(variants[name]) for s in per_launch]
    elements = sum(x.numel() for x in tensors)
    timing = dict(
        preset=preset,
        hadamard=hb,
        tensors=len(tensors),
        items=plans["grouped"].items,
        persistent_programs=plans["persistent"].programs,
        plan_seconds=plan_seconds,
        elements=elements,
        floor_ms=1e3 * 3 * elements / (COPY_TB_PER_S * 1e12),  # bf16 in, E4M3 out
        ms={name: dict(median=statistics.median(v), min=min(v), max=max(v), runs=v) for name, v in ms.items()},
    )
    return checks, timing


def table(timings: list[dict]) -> str:
    """Milliseconds per set of weights (median [min, max]) and the saving of the better grouped launch."""
    lines = [
        "| weights | H | launches | grouped items | per-tensor ms | grouped ms | persistent ms "
        f"| grouped {WIDE_REGISTERS} reg ms | saving ms / step | bytes floor ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        cells = [f"{m['median']:.3f} [{m['min']:.3f}, {m['max']:.3f}]" for m in t["ms"].values()]
        best = min(m["median"] for name, m in t["ms"].items() if name != "per-tensor")
        saving = t["ms"]["per-tensor"]["median"] - best
        lines.append(
            f"| {t['preset']} | {t['hadamard']} | {t['tensors']} | {t['items']} | {' | '.join(cells)} | "
            f"{saving:.3f} | {t['floor_ms']:.3f} |"
        )
    return "\n".join(lines)


def run(args) -> int:
    start = time.perf_counter()
    device = torch.device("cpu" if DRY else "cuda")
    info = dict(torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("ADAHOP_COMMIT", ""),
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)")  # fmt: skip
    print(info, flush=True)
    out = Path(args.out) if args.out else None
    results = dict(info=info, checks=[], timings=[], skipped=[])
    repeats = 1 if DRY else args.repeats

    def save():
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / "grouped_ab.json", json.dumps(results, indent=1, default=str))

    hard = mixed_hard_tensors(seed=1, device=device)
    for hb in HADAMARDS:
        plan = plan_grouped_fold(hard, hadamard_block_size=hb)
        plan.launch()
        results["checks"].append(checks_of(f"hard rows, mixed shapes H{hb}", hard, plan, hb))
    for preset, overrides in (DRY_PRESETS if DRY else PRESETS).items():
        for hb in HADAMARDS:
            if time.perf_counter() - start > args.budget:
                results["skipped"].append(f"{preset} H{hb}")
                print(f"skipped (past {args.budget} s): {preset} H{hb}", flush=True)
                continue
            checks, timing = stage(preset, overrides, hb, device, repeats)
            results["checks"] += checks
            results["timings"].append(timing)
            print(table([timing]).splitlines()[-1], flush=True)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    exact = all(c["exact"] for c in results["checks"])
    results["bit_exact"] = exact
    summary = table(results["timings"])
    print(f"\nbit-exact: {exact} ({sum(c['exact'] for c in results['checks'])}/{len(results['checks'])} checks)")
    print("\n" + summary)
    print(f"\n{time.perf_counter() - start:.0f} s; skipped: {results['skipped'] or 'nothing'}")
    save()
    if out is not None:
        write_atomic(out / "grouped_ab.md", summary + "\n")
    return 0 if exact else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (or DRY=1)")
    parser.add_argument("--out", help="folder for grouped_ab.json and grouped_ab.md (the device's $OUT)")
    parser.add_argument("--repeats", type=int, default=20, help="timed graph replays per run (two runs per variant)")
    parser.add_argument("--budget", type=float, default=140, help="no stage starts after this many seconds")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
