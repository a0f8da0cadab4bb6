"""Bandwidth of the fused MX quantizer against a device-to-device copy measured in the same run.

Bandwidth counts the bytes the kernel must move (input read once, packed codes and scales
written) and is reported as a fraction of the copy's (bytes read + written). Cases run with the
default tiling; ``--sweep`` also tries every tiling in ``TILINGS`` and keeps the fastest
(one compilation each).

    PYTHONPATH=src python benchmarks/bench_quantize.py --out benchmarks/results/quantize.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import asdict, dataclass

import torch
import triton
from triton.testing import do_bench

from adahop.kernels.quantize import (
    CUDA_TILING,
    QuantizeTiling,
    quantize_mx_triton,
    quantize_mx_triton_both,
)

TILINGS = (
    CUDA_TILING,
    QuantizeTiling(block_m=32, block_n=256, num_warps=4),
    QuantizeTiling(block_m=64, block_n=64, num_warps=4),
    QuantizeTiling(block_m=64, block_n=128, num_warps=4),
    QuantizeTiling(block_m=128, block_n=128, num_warps=8),
)
ORIENTATIONS = ("rowwise", "colwise", "both")
ROUNDINGS = ("nearest", "stochastic")


@dataclass
class Result:
    orientation: str
    hadamard_block_size: int | None
    rounding: str
    tiling: dict
    ms: float
    gb_per_s: float
    fraction_of_copy: float


def copy_gb_per_s(x: torch.Tensor) -> float:
    dst = torch.empty_like(x)
    ms = do_bench(lambda: dst.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6


def run_case(x, orientation, hadamard_block_size, rounding, tiling):
    kwargs = {"rounding": rounding, "seed": 1, "tiling": tiling}
    kwargs["hadamard_block_size"] = hadamard_block_size
    if orientation == "both":
        fn = lambda: quantize_mx_triton_both(x, **kwargs)
    else:
        fn = lambda: quantize_mx_triton(x, axis=-1 if orientation == "rowwise" else 0, **kwargs)
    outputs = fn()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    moved = x.numel() * x.element_size() + sum(out.nbytes for out in outputs)
    ms = do_bench(fn)
    return ms, moved / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--hadamard-block-size", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="try every tiling in TILINGS")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quantize needs a CUDA device")

    tilings = TILINGS if args.sweep else (CUDA_TILING,)
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    copy = copy_gb_per_s(x)
    print(f"device-to-device copy: {copy:.0f} GB/s")
    row = "{:<10} {:>8} {:<10} {:<14} {:>7} {:>7} {:>7}"
    print(row.format("orientation", "hadamard", "rounding", "tiling", "ms", "GB/s", "of copy"))
    results = []
    for orientation in ORIENTATIONS:
        for hb in (None, args.hadamard_block_size):
            for rounding in ROUNDINGS:
                timed = [(run_case(x, orientation, hb, rounding, t), t) for t in tilings]
                (ms, gbps), tiling = min(timed, key=lambda r: r[0][0])
                res = Result(orientation, hb, rounding, asdict(tiling), ms, gbps, gbps / copy)
                results.append(res)
                shape = f"{tiling.block_m}x{tiling.block_n}/{tiling.num_warps}w"
                cells = (f"{ms:.3f}", f"{gbps:.0f}", f"{res.fraction_of_copy:.2f}")
                print(row.format(orientation, hb or "-", rounding, shape, *cells))

    nearest = [r.fraction_of_copy for r in results if r.rounding == "nearest"]
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": [args.rows, args.cols],
        "dtype": "bfloat16",
        "copy_gb_per_s": copy,
        # Worst round-to-nearest case (either orientation or both, with or without Hadamard).
        "quantize_fraction_of_copy_bw": min(nearest),
        "cases": [asdict(r) for r in results],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"worst round-to-nearest fraction of copy bandwidth: {min(nearest):.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
