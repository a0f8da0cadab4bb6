"""Time the top-k selection kernel at the step's size for each warp count (GPU).

The selection runs as one program, so its time is latency: fewer warps mean cheaper cross-warp
reductions and histograms, more warps more parallel compares and fewer registers a thread (the
radix select spills at 8 warps for 8192 scores and at 16 for 16384: select_sm90.py). Prints microseconds per call (CUDA graph replay).
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench_cudagraph

from adahop.kernels.select import DIGIT_BITS, _top_rows_kernel


def main() -> None:
    for n in (2048, 8192, 16384):
        scores = torch.randn(n, device="cuda", dtype=torch.bfloat16).abs()
        out = torch.empty(64, dtype=torch.int64, device="cuda")
        n_pad = triton.next_power_of_2(n)
        for warps in (1, 2, 4, 8, 16):
            launch = lambda warps=warps: _top_rows_kernel[(1,)](  # noqa: E731
                scores, out, n, 64, N_PAD=n_pad, DIGIT_BITS=DIGIT_BITS, num_warps=warps
            )
            launch()
            print(f"n={n} warps={warps}: {do_bench_cudagraph(launch) * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
