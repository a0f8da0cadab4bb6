"""``adahop bench``: GPU benchmarks, each a ratio to its baseline measured in the same run.

Sections: ``gemm`` (MXFP4 GEMM routes vs cuBLAS BF16 at the Llama-3-8B shapes), ``quantize``
(fused quantizer bandwidth vs a device copy), ``linear`` (AdaHOPLinear forward+backward and
saved activations vs BF16 ``nn.Linear``) and ``step`` (whole training steps of a Llama per recipe
vs BF16, with a profile). Writes ``<out>.json`` and a ``<out>.md`` summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from ..atomic import write_atomic
from .common import environment

SECTIONS = ("gemm", "quantize", "linear", "step")
# The headline figure of each section, as the issue names it.
HEADLINES = {
    "gemm": ("gemm_speedup_vs_bf16", "MXFP4 GEMM (the route gemm_route picks) vs cuBLAS BF16, geomean of 4 shapes"),
    "quantize": ("quantize_fraction_of_copy_bw", "fused quantizer, fraction of copy bandwidth"),
    "linear": ("linear_fwd_bwd_speedup_vs_bf16", "AdaHOPLinear fwd+bwd, calibrated lv2 mix vs nn.Linear"),
    "step": (
        "train_step_speedup_vs_bf16",
        "llama3_1b 4x2048 training step, adahop_lv2 vs bf16, best mode of each (tokens/s)",
    ),
}
# Further figures a section reports next to its headline.
EXTRA_FIGURES = {
    "oe_split_slowdown_vs_mxfp4": "OE split GEMM (k = 64, worst shape and side), time over plain MXFP4 GEMM, minus 1",
    "quantize_rowwise_fraction_of_copy_bw": "fused quantizer, row-wise RN without Hadamard, fraction of copy bandwidth",
    "saved_activation_compression": "saved activations, BF16 / AdaHOP, calibrated lv2 mix",
    "train_step_speedup_vs_bf16_1b_8x": "llama3_1b 8x2048 training step, adahop_lv2 vs bf16, best modes (tokens/s)",
    "train_step_speedup_vs_bf16_3b": "llama3_3b 4x2048 training step, adahop_lv2 vs bf16, best modes (tokens/s)",
    "train_step_speedup_vs_float8": "llama3_1b 4x2048 training step, adahop_lv2 vs torchao float8 tensorwise, best modes",
    "train_step_speedup_vs_float8_1b_8x": "llama3_1b 8x2048 training step, adahop_lv2 vs torchao float8 tensorwise, best modes",
    "train_step_speedup_vs_float8_3b": "llama3_3b 4x2048 training step, adahop_lv2 vs torchao float8 tensorwise, best modes",
    "peak_memory_ratio_vs_bf16": "llama3_1b 8x2048 peak reserved memory, adahop_lv2 / bf16, best modes",
    "run_peak_memory_ratio_vs_bf16": (
        "llama3_1b 8x2048 peak reserved memory of the whole run (calibration, capture), adahop_lv2 / bf16, best modes"
    ),
    "run_peak_memory_ratio_vs_float8": (
        "llama3_1b 8x2048 peak reserved memory of the whole run, adahop_lv2 / torchao float8 tensorwise, best modes"
    ),
    "linear_fwd_bwd_speedup_vs_bf16_lv1": "AdaHOPLinear fwd+bwd, calibrated lv1 mix vs nn.Linear",
    "saved_activation_compression_lv1": "saved activations, BF16 / AdaHOP, calibrated lv1 mix",
}


def summary_markdown(report: dict) -> str:
    lines = [
        f"# adahop bench: {report['gpu']}, {report['date']}",
        "",
        f"torch {report['torch']}, triton {report['triton']}, CUDA {report['cuda']}, "
        f"Python {report['python']}. Every figure is a ratio to a baseline measured in the same run.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for section, (key, what) in HEADLINES.items():
        if key in report:
            lines.append(f"| {what} (`{key}`) | {report[key]:.3f} |")
    for key, what in EXTRA_FIGURES.items():
        if key in report:
            lines.append(f"| {what} (`{key}`) | {report[key]:.3f} |")
    for section in SECTIONS:
        if section in report:
            lines += importlib.import_module(f"{__name__}.{section}").markdown(report[section])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adahop bench", description=__doc__)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    parser.add_argument(
        "--quantize-sweep",
        action="store_true",
        help="time every candidate tiling of the quantizer and report the fastest of each case",
    )
    parser.add_argument(
        "--step-cases", default="", help="comma-separated subset of the step cases (e.g. llama3_1b_4x2048); default all"
    )
    parser.add_argument(
        "--step-runs",
        default="",
        help="comma-separated subset of each step case's runs (e.g. bf16/fastest,adahop_lv2/compile+graph)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the step section on the CPU with a 2-layer model and a few steps: checks the plumbing, measures nothing",
    )
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")

    import torch

    if args.dry_run and sections != ["step"]:
        parser.error("--dry-run runs the step section only: pass --only step")
    if not torch.cuda.is_available() and not args.dry_run:
        parser.error("benchmarks need a CUDA GPU (--only step --dry-run checks the step bench on the CPU)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    report = environment()
    for section in sections:
        options = {"sweep": True} if section == "quantize" and args.quantize_sweep else {}
        if section == "step" and args.out:
            options["partial"] = args.out.with_suffix(".partial.json")
        if section == "step" and args.dry_run:
            from .step import DRY_RUN, DRY_RUN_CASES

            options |= {"settings": DRY_RUN, "cases": DRY_RUN_CASES}
        if section == "step" and (args.step_cases or args.step_runs):
            from .step import CASES, DRY_RUN_CASES, select_cases

            names = [k for k in args.step_cases.split(",") if k]
            runs = [r for r in args.step_runs.split(",") if r] or None
            try:
                options["cases"] = select_cases(names, runs, DRY_RUN_CASES if args.dry_run else CASES)
            except ValueError as err:
                parser.error(str(err))
        result = importlib.import_module(f"{__name__}.{section}").run(**options)
        report[section] = result
        for key in (HEADLINES[section][0], *EXTRA_FIGURES):
            if key in result:
                report[key] = result[key]
        print(f"{section}: " + ", ".join(f"{k}={result[k]:.3f}" for k in result if isinstance(result[k], float)))
    if args.out:
        write_atomic(args.out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
        write_atomic(args.out.with_suffix(".md"), summary_markdown(report))
    print(summary_markdown(report))
    return 0
