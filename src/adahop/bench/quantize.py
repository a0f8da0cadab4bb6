"""Bandwidth of the fused MX quantizer against a device-to-device copy measured in the same run.

Bandwidth counts the bytes the kernel must move (input read once, packed codes and scales
written) and is reported as a fraction of the copy's (bytes read + written). Both are timed
inside CUDA graphs, so the numbers are the kernels' own; ``call_ms`` is the eager call with its
Python and launch overhead (about 0.16 ms on the H200 host, longer than the kernels at
16384x4096). Cases run with the default tiling of their orientation; a sweep
(``adahop bench --quantize-sweep``) times every tiling in ``TILINGS`` and keeps the fastest.
Sweep variants are compiled first by a pool of processes (each fills Triton's on-disk cache
from a small input with the same specialization), so the timed loop only loads binaries. "both" is also compared with the two single-orientation calls it replaces.

Run as the ``quantize`` section of ``adahop bench``.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
from triton.testing import do_bench, do_bench_cudagraph

from ..kernels.fold import fold_to_fp8
from ..kernels.quantize import quantize_mx_triton, quantize_mx_triton_both
from ..kernels.quantize_fold import quantize_fold_fp8
from ..kernels.quantize_tiling import QuantizeTiling, default_tiling

# Candidates of ``--quantize-sweep``: tile areas of 1-32K elements on 1-8 warps.
TILINGS = (
    QuantizeTiling(block_m=8, block_n=256, num_warps=2),
    QuantizeTiling(block_m=16, block_n=128, num_warps=1),
    QuantizeTiling(block_m=16, block_n=128, num_warps=2),
    QuantizeTiling(block_m=16, block_n=256, num_warps=4),
    QuantizeTiling(block_m=16, block_n=512, num_warps=8),
    QuantizeTiling(block_m=32, block_n=32, num_warps=1),
    QuantizeTiling(block_m=32, block_n=64, num_warps=1),
    QuantizeTiling(block_m=32, block_n=128, num_warps=1),
    QuantizeTiling(block_m=32, block_n=128, num_warps=2),
    QuantizeTiling(block_m=32, block_n=128, num_warps=4),
    QuantizeTiling(block_m=32, block_n=256, num_warps=4),
    QuantizeTiling(block_m=32, block_n=256, num_warps=8),
    QuantizeTiling(block_m=64, block_n=64, num_warps=2),
    QuantizeTiling(block_m=64, block_n=128, num_warps=4),
    QuantizeTiling(block_m=64, block_n=128, num_warps=8),
    QuantizeTiling(block_m=64, block_n=256, num_warps=4),
    QuantizeTiling(block_m=64, block_n=256, num_warps=8),
    QuantizeTiling(block_m=128, block_n=128, num_warps=8),
)
ORIENTATIONS = ("rowwise", "colwise", "both")
ROUNDINGS = ("nearest", "stochastic")
WARMUP_ROWS = 256  # a multiple of 16: the same kernel specialization as the full-size input


@dataclass
class Result:
    orientation: str
    hadamard_block_size: int  # 0: none
    rounding: str
    tiling: dict
    ms: float
    gb_per_s: float
    fraction_of_copy: float
    call_ms: float


def graph_copy_gb_per_s(x: torch.Tensor) -> float:
    """Copy bandwidth (read + write) timed inside a CUDA graph, like the kernels."""
    dst = torch.empty_like(x)
    ms = do_bench_cudagraph(lambda: dst.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6


@functools.cache
def graph_seed(device: torch.device) -> torch.Tensor:
    """The Philox key as a device tensor made before any capture: a Python int would be copied
    to the device inside the CUDA graph that times the kernel, which capture forbids."""
    return torch.tensor(1, dtype=torch.int64, device=device)


def quantize_fn(x, orientation, hadamard_block_size, rounding, tiling):
    kwargs = {"rounding": rounding, "seed": graph_seed(x.device), "tiling": tiling}
    kwargs["hadamard_block_size"] = hadamard_block_size
    if orientation == "both":
        return lambda: quantize_mx_triton_both(x, **kwargs)
    return lambda: quantize_mx_triton(x, axis=-1 if orientation == "rowwise" else 0, **kwargs)


def run_case(x, orientation, hadamard_block_size, rounding, tiling) -> tuple[float, float, float]:
    """Kernel ms (CUDA graph), its GB/s, and the eager call's ms."""
    fn = quantize_fn(x, orientation, hadamard_block_size, rounding, tiling)
    outputs = fn()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    moved = x.numel() * x.element_size() + sum(out.nbytes for out in outputs)
    ms = do_bench_cudagraph(fn)
    return ms, moved / ms / 1e6, do_bench(fn)


def compile_case(cols: int, case: tuple) -> None:
    """Compile one case's kernel (in a worker process) into Triton's cache."""
    x = torch.randn(WARMUP_ROWS, cols, device="cuda", dtype=torch.bfloat16)
    quantize_fn(x, *case)()
    torch.cuda.synchronize()


def compile_all(cols: int, cases: list[tuple]) -> None:
    workers = min(len(cases), os.cpu_count() or 1)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(compile_case, itertools.repeat(cols), cases))


def run(rows: int = 16384, cols: int = 4096, hadamard_block_size: int = 32, sweep: bool = False) -> dict:
    """Every orientation x Hadamard x rounding case, as fractions of the copy bandwidth."""
    if rows % WARMUP_ROWS:
        raise ValueError(f"rows must be a multiple of {WARMUP_ROWS}")
    device = torch.device("cuda")
    settings = list(itertools.product(ORIENTATIONS, (0, hadamard_block_size), ROUNDINGS))
    candidates = {s: TILINGS if sweep else (default_tiling(s[0], device, bool(s[1])),) for s in settings}
    compile_all(cols, [(*s, t) for s in settings for t in candidates[s]])

    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    copy = graph_copy_gb_per_s(x)
    print(f"device-to-device copy: {copy:.0f} GB/s")
    row = "{:<10} {:>8} {:<10} {:<14} {:>7} {:>7} {:>7} {:>8}"
    print(row.format("orientation", "hadamard", "rounding", "tiling", "ms", "GB/s", "of copy", "call ms"))
    results, timings = {}, []
    for setting in settings:
        timed = [(run_case(x, *setting, t), t) for t in candidates[setting]]
        timings += [{"case": list(setting), "tiling": asdict(t), "ms": r[0]} for r, t in timed]
        (ms, gbps, call_ms), tiling = min(timed, key=lambda r: r[0][0])
        res = Result(*setting, asdict(tiling), ms, gbps, gbps / copy, call_ms)
        results[setting] = res
        shape = f"{tiling.block_m}x{tiling.block_n}/{tiling.num_warps}w"
        cells = (f"{ms:.3f}", f"{gbps:.0f}", f"{res.fraction_of_copy:.2f}", f"{call_ms:.3f}")
        print(row.format(setting[0], setting[1] or "-", setting[2], shape, *cells))

    # "both" against the row-wise plus column-wise calls it replaces (< 1: one read pays off).
    both_vs_separate = {
        f"{hb or 'none'}/{rounding}": results["both", hb, rounding].ms
        / (results["rowwise", hb, rounding].ms + results["colwise", hb, rounding].ms)
        for _, hb, rounding in settings
    }
    folded = run_folded(x, hadamard_block_size, copy)
    nearest = [r.fraction_of_copy for r in results.values() if r.rounding == "nearest"]
    return {
        "shape": [rows, cols],
        "dtype": "bfloat16",
        "copy_gb_per_s": copy,
        # Worst round-to-nearest case (either orientation or both, with or without Hadamard).
        "quantize_fraction_of_copy_bw": min(nearest),
        # The plain case: row-wise, round to nearest, no Hadamard (forward operands under MXFP4).
        "quantize_rowwise_fraction_of_copy_bw": results["rowwise", 0, "nearest"].fraction_of_copy,
        "best_fraction_of_copy_bw": max(r.fraction_of_copy for r in results.values()),
        "both_time_vs_two_calls": both_vs_separate,
        "cases": [asdict(r) for r in results.values()],
        "folded": folded,
        "sweep": timings,
    }


def run_folded(x: torch.Tensor, hadamard_block_size: int, copy: float) -> list[dict]:
    """What the training step runs besides the packed quantizer: row-wise quantization straight
    into the folded E4M3 operand (forward X and W, dgrad's dY), per Hadamard and rounding, and
    the fold of a packed column-wise operand (wgrad's saved X and dY, dgrad's Wᵀ)."""
    cases = {}
    for hb, rounding in itertools.product((0, hadamard_block_size), ROUNDINGS):
        options = dict(rounding=rounding, seed=graph_seed(x.device), hadamard_block_size=hb)
        cases["quantize_fold", hb, rounding] = (lambda options=options: quantize_fold_fp8(x, **options), x.nbytes)
    packed = quantize_mx_triton(x, axis=-1)  # the layout a column-wise operand is stored in
    cases["fold", 0, "-"] = (lambda: fold_to_fp8(packed), packed.data.nbytes + packed.scales.nbytes)
    results = []
    for (kernel, hb, rounding), (fn, read) in cases.items():
        out = fn()
        ms = do_bench_cudagraph(fn)
        moved = read + out.data.nbytes + out.row_scale.nbytes
        results.append(
            dict(kernel=kernel, hadamard_block_size=hb, rounding=rounding, ms=ms, fraction=moved / ms / 1e6 / copy)
        )
        print(f"{kernel:<14} {hb or '-':>8} {rounding:<10} {ms:>7.3f} {results[-1]['fraction']:>7.2f}")
    return results


def markdown(result: dict) -> list[str]:
    """This section of the bench summary: quantizer time and bandwidth per case."""
    lines: list[str] = []
    lines += [
        "",
        f"Fused quantizer at {result['shape'][0]}x{result['shape'][1]} {result['dtype']} (copy: "
        f"{result['copy_gb_per_s']:.0f} GB/s, read + write):",
        "",
        "| orientation | Hadamard | rounding | tiling | kernel ms | of copy |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        t = c["tiling"]
        lines.append(
            f"| {c['orientation']} | {c['hadamard_block_size'] or '-'} | {c['rounding']} | "
            f"{t['block_m']}x{t['block_n']}/{t['num_warps']}w | {c['ms']:.3f} | {c['fraction_of_copy']:.2f} |"
        )
    lines += [
        "",
        "Into the folded E4M3 operand (bytes: input read, E4M3 and row scales written; the fold reads packed MXFP4):",
        "",
        "| kernel | Hadamard | rounding | kernel ms | of copy |",
        "|---|---|---|---|---|",
    ]
    for c in result.get("folded", []):
        lines.append(
            f"| {c['kernel']} | {c['hadamard_block_size'] or '-'} | {c['rounding']} | {c['ms']:.3f} | "
            f"{c['fraction']:.2f} |"
        )
    return lines
