"""Bandwidth of the fused MX quantizer against a device-to-device copy measured in the same run.

Bandwidth counts the bytes the kernel must move (input read once, packed codes and scales
written) and is reported as a fraction of the copy's (bytes read + written). Each case runs
every tiling in ``TILINGS`` and keeps the fastest.

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

from adahop.kernels.quantize import QuantizeTiling, quantize_mx_triton, quantize_mx_triton_both

TILINGS = (
    QuantizeTiling(block_m=32, block_n=128, num_warps=4),
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
    kwargs = dict(rounding=rounding, seed=1, hadamard_block_size=hadamard_block_size, tiling=tiling)
    if orientation == "both":
        fn = lambda: quantize_mx_triton_both(x, **kwargs)  # noqa: E731
    else:
        fn = lambda: quantize_mx_triton(x, axis=-1 if orientation == "rowwise" else 0, **kwargs)  # noqa: E731
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quantize needs a CUDA device")

    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    copy = copy_gb_per_s(x)
    print(f"device-to-device copy: {copy:.0f} GB/s")
    print(f"{'orientation':<10} {'hadamard':>8} {'rounding':<10} {'tiling':<14} {'ms':>7} {'GB/s':>7} {'of copy':>7}")
    results = []
    for orientation in ORIENTATIONS:
        for hb in (None, args.hadamard_block_size):
            for rounding in ROUNDINGS:
                timed = [(run_case(x, orientation, hb, rounding, t), t) for t in TILINGS]
                (ms, gbps), tiling = min(timed, key=lambda r: r[0][0])
                res = Result(orientation, hb, rounding, asdict(tiling), ms, gbps, gbps / copy)
                results.append(res)
                shape = f"{tiling.block_m}x{tiling.block_n}/{tiling.num_warps}w"
                print(f"{orientation:<10} {hb or '-':>8} {rounding:<10} {shape:<14} {ms:7.3f} {gbps:7.0f} {res.fraction_of_copy:7.2f}")

    nearest = [r.fraction_of_copy for r in results if r.rounding == "nearest"]
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": [args.rows, args.cols],
        "dtype": "bfloat16",
        "copy_gb_per_s": copy,
        # Worst round-to-nearest case (either orientation or both, with or without Hadamard).
        "quantize_fraction_of_copy_bw": min(nearest),
        "cases": [asdict(r) for r in results],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"worst round-to-nearest fraction of copy bandwidth: {min(nearest):.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
