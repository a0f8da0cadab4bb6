"""The quantize-path kernels of a `llama3_1b` 4x2048 training step at its shapes (GPU).

Without arguments: microseconds per call of each case (CUDA graph replay, ``do_bench_cudagraph``),
so two source trees can be compared in one machine call (``PYTHONPATH=A/src`` then ``B/src``).
``--once`` launches each case twice and stops, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats -k regex:"_quantize|_fold|_top_rows" python benchmarks/quantize/quantize_kernels.py --once

(the first launch of each case compiles and is profiled too, identically). Shapes are the step's
(8192 tokens; dim 2048, hidden 8192, 512-wide K/V).
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench_cudagraph

from adahop.kernels.fold import fold_to_fp8
from adahop.kernels.quantize import quantize_mx_triton
from adahop.kernels.quantize_fold import quantize_fold_fp8
from adahop.kernels.select import top_rows_triton

TOKENS = 8192
SHAPES = {"x_2048": (TOKENS, 2048), "dy_8192": (TOKENS, 8192), "dy_512": (TOKENS, 512), "w2": (2048, 8192)}


def cases(seed: torch.Tensor) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = {k: torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) for k, s in SHAPES.items()}
    packed = quantize_mx_triton(x["w2"], axis=-1, hadamard_block_size=32)  # Xᵀ's layout: [2048, 8192]
    packed_dy = quantize_mx_triton(x["dy_8192"], axis=-1, hadamard_block_size=32)  # dYᵀ's: [8192, 8192]
    # wk/wv's dYᵀ, [512, 8192]: few long rows, each split into parts by the fold's launch plan
    packed_kv = quantize_mx_triton(x["dy_512"].t().contiguous(), axis=-1, hadamard_block_size=32)
    scores = x["dy_8192"][:, 0].float().abs()
    scores_16k = x["dy_8192"][:2].flatten().float().abs()  # the largest selection of a 1b 8x2048 step
    return {
        "fold_rows x_2048 H32 RN": lambda: quantize_fold_fp8(x["x_2048"], hadamard_block_size=32),
        "fold_rows dy_8192 H32 SR": lambda: quantize_fold_fp8(
            x["dy_8192"], rounding="stochastic", seed=seed, hadamard_block_size=32
        ),
        "fold_rows dy_512 H32 SR": lambda: quantize_fold_fp8(
            x["dy_512"], rounding="stochastic", seed=seed, hadamard_block_size=32
        ),
        "fold_rows w2 H32 RN": lambda: quantize_fold_fp8(x["w2"], hadamard_block_size=32),
        "cols x_2048 H32 RN": lambda: quantize_mx_triton(x["x_2048"], axis=0, hadamard_block_size=32),
        "cols dy_8192 H32 SR": lambda: quantize_mx_triton(
            x["dy_8192"], axis=0, rounding="stochastic", seed=seed, hadamard_block_size=32
        ),
        # about one wave of programs: where the column-wise kernel's occupancy shows most
        "cols dy_512 H32 SR": lambda: quantize_mx_triton(
            x["dy_512"], axis=0, rounding="stochastic", seed=seed, hadamard_block_size=32
        ),
        "fold xT_2048": lambda: fold_to_fp8(packed),
        "fold dyT_8192": lambda: fold_to_fp8(packed_dy),
        "fold dyT_512": lambda: fold_to_fp8(packed_kv),
        "top_rows 8192 k64": lambda: top_rows_triton(scores, 64),
        "top_rows 16384 k64": lambda: top_rows_triton(scores_16k, 64),
    }


def main() -> None:
    seed = torch.tensor(1, dtype=torch.int64, device="cuda")
    for name, fn in cases(seed).items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        if "--once" in sys.argv:
            print(name, flush=True)
        else:
            print(f"{name:<28} {do_bench_cudagraph(fn) * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
