"""TFLOP/s of every ``route_matmul`` route against cuBLAS BF16 on the Llama-3-8B linear shapes.

Each route runs from MXFP4 operands: ``fold_fp8`` is timed with its fold (end to end) and
without (operands folded beforehand, as a fold fused into quantization would leave them).
Accuracy is the relative Frobenius error against a float64 GEMM of the dequantized operands, on
sampled rows, with FP32 output (and with BF16 output against the rounded reference). A second
input whose blocks span 20 binades per row shows the fold's underflow count. The outlier-extraction
split (MXFP4 product plus a BF16 GEMM on the k = 64 extracted rows of either operand, written into
the output) is timed against the plain MXFP4 product of the same prepared operands.

Run as part of ``adahop bench`` (section ``gemm``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from .. import ops
from ..formats import MXTensor, quantize_mx
from ..gemm import QuantSpec, prepare_operand, tn_matmul
from ..kernels.fold import FoldConfig, fold_to_fp8, planned_config
from ..kernels.gemm import fold_fp8_matmul, route_matmul
from ..kernels.gemm_triton import _mxfp4_dot_scaled_kernel, _mxfp4_fp8_kernel
from ..policy import Strategy
from ..policy.routes import KERNEL_ROUTES, gemm_route
from .common import copy_gb_per_s, geomean, ms_of, tflops

LLAMA3_8B_SHAPES = ((16384, 4096, 4096), (16384, 14336, 4096), (16384, 4096, 14336), (16384, 6144, 4096))
ROUTES = tuple(r.value for r in KERNEL_ROUTES)
FOLD_CONFIGS = (  # besides the planned one (kernels.fold.fold_plan)
    FoldConfig(),
    FoldConfig(block_r=8, chunk=32),
    FoldConfig(block_r=1, chunk=256, num_warps=8),
)
OE_K = 64  # outlier rows or columns in the BF16 path, as in the paper
SPREAD_BINADES = 20  # block scales of the underflow stress input span this many binades


def inputs(m: int, n: int, k: int, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 activations [m, k] and weights [n, k]; ``spread`` scales each 32-channel group of the
    activations by 2**U{-10..9}, so blocks of one row span 20 binades (the fold's worst case)."""
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen)
    if spread:
        groups = torch.randint(-SPREAD_BINADES // 2, SPREAD_BINADES // 2, (k // 32,), device="cuda", generator=gen)
        x = x * torch.exp2(groups.float()).repeat_interleave(32)
    w = 0.02 * torch.randn(n, k, device="cuda", generator=gen)
    return x.bfloat16(), w.bfloat16()


def rel_errors(a: MXTensor, b: MXTensor, rows: torch.Tensor, **matmul_kwargs) -> dict[str, float]:
    """Errors of ``route_matmul`` against float64 on ``rows`` of the output: FP32 out, and BF16 out."""
    ref = a.dequantize()[rows].double() @ b.dequantize().double().T
    out32 = route_matmul(a, b, out_dtype=torch.float32, **matmul_kwargs)[rows].double()
    out16 = route_matmul(a, b, out_dtype=torch.bfloat16, **matmul_kwargs)[rows].double()
    ref16 = ref.to(torch.bfloat16).double()
    return {
        "rel_error_fp32_out": ((out32 - ref).norm() / ref.norm()).item(),
        "rel_error_bf16_out_vs_rounded_ref": ((out16 - ref16).norm() / ref16.norm()).item(),
        "rel_error_bf16_out": ((out16 - ref).norm() / ref.norm()).item(),
    }


def bench_fold(mx: MXTensor) -> dict:
    """Fastest fold config for ``mx`` and its bandwidth (packed codes + scales in, FP8 out)."""
    moved = mx.nbytes + mx.data.numel() * 2 + 8 * mx.scales.shape[0]
    configs = (planned_config(mx), *FOLD_CONFIGS)
    timings = {cfg: ms_of(lambda cfg=cfg: fold_to_fp8(mx, cfg)) for cfg in configs}
    best = min(timings, key=timings.get)
    return {"ms": timings[best], "gb_per_s": moved / timings[best] / 1e6, "config": asdict(best)}


def bench_shape(m: int, n: int, k: int, error_rows: int, copy_bw: float) -> dict:
    x, w = inputs(m, n, k)
    a, b = quantize_mx(x, axis=1), quantize_mx(w, axis=1)
    rows = torch.randperm(m, device="cuda")[:error_rows]
    bf16_ms = ms_of(lambda: x @ w.T)
    result = {"M": m, "N": n, "K": k, "bf16_tflops": tflops(m, n, k, bf16_ms), "routes": {}}

    fold_a, fold_b = bench_fold(a), bench_fold(b)
    fa, fb = fold_to_fp8(a), fold_to_fp8(b)
    result["fold"] = {"a": fold_a, "b": fold_b, "lossy_a": fa.n_lossy, "lossy_b": fb.n_lossy}
    result["fold"]["fraction_of_copy_bw"] = fold_a["gb_per_s"] / copy_bw
    ref = a.dequantize()[rows].double() @ b.dequantize().double().T
    for fast in (True, False):  # cuBLAS's FP8 accumulation with and without periodic promotion
        ms = ms_of(lambda fast=fast: fold_fp8_matmul(fa, fb, torch.bfloat16, fast))
        out = fold_fp8_matmul(fa, fb, torch.float32, fast)[rows].double()
        result[f"fold_fp8_gemm_only_fast_accum_{fast}"] = {
            "tflops": tflops(m, n, k, ms),
            "ratio_vs_bf16": bf16_ms / ms,
            "rel_error_fp32_out": ((out - ref).norm() / ref.norm()).item(),
        }

    for route in ROUTES:
        try:
            ms = ms_of(lambda route=route: route_matmul(a, b, route=route))
            entry = {"tflops": tflops(m, n, k, ms), "ratio_vs_bf16": bf16_ms / ms}
            entry.update(rel_errors(a, b, rows, route=route))
        except Exception as err:  # noqa: BLE001 - a route that fails on this GPU is reported, not fatal
            entry = {"error": f"{type(err).__name__}: {err}"[:500]}
        result["routes"][route] = entry
        torch.cuda.empty_cache()
    for route, kernel in (("triton_fp8", _mxfp4_fp8_kernel), ("dot_scaled", _mxfp4_dot_scaled_kernel)):
        result["routes"][route]["autotuned"] = str(getattr(kernel, "best_config", None))
    return result


def oe_split(m: int, n: int, k: int, copy_bw: float, rounds: int = 3) -> dict:
    """Time of the OE split GEMM (OE-left: k rows of C, OE-right: k columns of C from the BF16 path)
    over the MXFP4 GEMM of the same prepared operands (top-k and quantization are the layer's,
    timed in the ``linear`` section); medians of interleaved rounds, as the two differ by a few
    percent. The BF16 path must read the whole dense other operand: ``dense_read_floor`` is that
    read at the copy bandwidth, as a fraction of the MXFP4 GEMM's time."""
    x, w = inputs(m, n, k)
    spec = QuantSpec()
    result = {"M": m, "N": n, "K": k, "oe_k": OE_K}
    for strategy in (Strategy.OE_LEFT, Strategy.OE_RIGHT):
        left = prepare_operand(x, strategy, "L", spec, oe_k=OE_K)
        right = prepare_operand(w, strategy, "R", spec, oe_k=OE_K)
        mxfp4, split = [], []
        for _ in range(rounds):
            mxfp4.append(ms_of(lambda: ops.mx_matmul(left.quantized, right.quantized, torch.bfloat16)))
            split.append(ms_of(lambda: tn_matmul(left, right, torch.bfloat16)))
        dense = right.dense if strategy is Strategy.OE_LEFT else left.dense
        mxfp4_ms, split_ms = statistics.median(mxfp4), statistics.median(split)
        result[strategy.value] = {
            "mxfp4_ms": mxfp4_ms,
            "ms": split_ms,
            "slowdown_vs_mxfp4": split_ms / mxfp4_ms - 1,
            "dense_read_floor": dense.nbytes / copy_bw / 1e6 / mxfp4_ms,
        }
    return result


def spread_case(m: int, n: int, k: int, error_rows: int) -> dict:
    """Underflow and accuracy of the fold when a row's blocks span 20 binades."""
    x, w = inputs(m, n, k, spread=True)
    a, b = quantize_mx(x, axis=1), quantize_mx(w, axis=1)
    rows = torch.randperm(m, device="cuda")[:error_rows]
    lossy = fold_to_fp8(a).n_lossy
    case = {"M": m, "N": n, "K": k, "block_binades": SPREAD_BINADES, "lossy_a": lossy}
    case["lossy_fraction_a"] = lossy / a.shape.numel()
    case["fold_fp8"] = rel_errors(a, b, rows, route="fold_fp8")
    case["fold_fp8_split_accum"] = rel_errors(a, b, rows, route="fold_fp8", fast_accum=False)
    case["triton_fp8"] = rel_errors(a, b, rows, route="triton_fp8")
    return case


def run(error_rows: int = 1024) -> dict:
    """Every route on every shape, ratios to cuBLAS BF16, plus the underflow stress case."""
    device = torch.device("cuda")
    copy_bw = copy_gb_per_s()
    shapes = [bench_shape(*shape, error_rows, copy_bw) for shape in LLAMA3_8B_SHAPES]
    auto = gemm_route(device, LLAMA3_8B_SHAPES[0][1]).value
    report = {
        "auto_route": auto,
        "copy_gb_per_s": copy_bw,
        "shapes": shapes,
        "route_speedup_vs_bf16": {
            r: geomean([s["routes"][r]["ratio_vs_bf16"] for s in shapes])
            for r in ROUTES
            if all("ratio_vs_bf16" in s["routes"][r] for s in shapes)
        },
        "gemm_speedup_vs_bf16_excluding_fold": geomean(
            [s["fold_fp8_gemm_only_fast_accum_True"]["ratio_vs_bf16"] for s in shapes]
        ),
        "spread_case": spread_case(*LLAMA3_8B_SHAPES[0], error_rows),
        "oe_split": [oe_split(*shape, copy_bw) for shape in LLAMA3_8B_SHAPES],
    }
    # Worst case over shapes and sides (target: <= 10%).
    report["oe_split_slowdown_vs_mxfp4"] = max(
        case[side]["slowdown_vs_mxfp4"] for case in report["oe_split"] for side in ("oe_left", "oe_right")
    )
    report["gemm_speedup_vs_bf16"] = report["route_speedup_vs_bf16"].get(auto, float("nan"))
    return report


def markdown(result: dict) -> list[str]:
    """This section of the bench summary: TFLOP/s per route and shape, and the OE split."""
    lines: list[str] = []
    lines += [
        "",
        "MXFP4 GEMM TFLOP/s (ratio to cuBLAS BF16) per route:",
        "",
        "| M, N, K | BF16 | " + " | ".join(ROUTES) + " | fold_fp8 without the fold |",
        "|---" * (len(ROUTES) + 3) + "|",
    ]
    for s in result["shapes"]:
        cells = [
            f"{e['tflops']:.0f} ({e['ratio_vs_bf16']:.2f}x)" if "tflops" in (e := s["routes"][r]) else "failed"
            for r in ROUTES
        ]
        excl = s["fold_fp8_gemm_only_fast_accum_True"]["ratio_vs_bf16"]
        lines.append(
            f"| {s['M']}, {s['N']}, {s['K']} | {s['bf16_tflops']:.0f} | " + " | ".join(cells) + f" | {excl:.2f}x |"
        )
    if "oe_split" in result:
        lines += [
            "",
            "Outlier-extraction split GEMM (k = 64 rows of L or of R in BF16) against the MXFP4 GEMM "
            "of the same operands (medians of interleaved rounds):",
            "",
            "| M, N, K | MXFP4 ms (left, right) | OE-left | OE-right | dense-read floor (left, right) |",
            "|---|---|---|---|---|",
        ]
        for c in result["oe_split"]:
            left, right = c["oe_left"], c["oe_right"]
            lines.append(
                f"| {c['M']}, {c['N']}, {c['K']} | {left['mxfp4_ms']:.3f}, {right['mxfp4_ms']:.3f} | "
                f"{left['ms']:.3f} ms ({left['slowdown_vs_mxfp4']:+.1%}) | "
                f"{right['ms']:.3f} ms ({right['slowdown_vs_mxfp4']:+.1%}) | "
                f"{left['dense_read_floor']:+.1%}, {right['dense_read_floor']:+.1%} |"
            )
    return lines
