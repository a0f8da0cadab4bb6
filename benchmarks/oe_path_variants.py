"""Where the time of the OE high-precision path goes, on a CUDA GPU (one run, ~30 s on an H200).

1. OE-right (``out[:, index] = a @ b.T``, dense ``a`` [16384, K]): tilings of the kernel, each with
   the 64 columns scattered (random or sorted), adjacent, or stored into a compact [M, 64] buffer;
   the difference is the cost of the column scatter. The reference op (cuBLAS + index_put) too.
2. OE-left (``out[index] = a @ b.T``, dense ``b`` [N, K]): tilings.
3. The OE split (``tn_matmul``) against the MXFP4 product of the same operands and against the
   plain MXFP4 GEMM, in three interleaved rounds (medians and every round).

Rows are [..., microseconds, GB/s of the dense operand]. ``python benchmarks/oe_path_variants.py
[--out FILE.json]``; the H200 result is ``results/2026-12-03-h200-oe-tilings.json``.
"""

import argparse
import json
import statistics

import torch
from triton.testing import do_bench

from adahop import ops
from adahop.gemm import QuantSpec, prepare_operand, tn_matmul
from adahop.kernels.mx_triton import cdiv
from adahop.kernels.outlier_matmul import _outlier_matmul_kernel
from adahop.policy import Strategy

TOKENS, OE_K = 16384, 64
RIGHT_TILINGS = ((64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 4))
LEFT_TILINGS = ((64, 64, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4))


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def launch(out, a, b, index, dim, block_m, block_n, block_k, warps, stages) -> None:
    (m, k), n = a.shape, b.shape[0]
    _outlier_matmul_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        a, b, out, index, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        INDEXED_ROWS=dim == 0, UPCAST=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )


def oe_right(res: dict) -> None:
    for k in (4096, 14336):
        m, n = TOKENS, 4096
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(OE_K, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        compact = torch.empty(m, OE_K, device="cuda", dtype=torch.bfloat16)
        idx, first = torch.randperm(n, device="cuda")[:OE_K], torch.arange(OE_K, device="cuda")
        stores = (("scatter", out, idx), ("sorted", out, idx.sort().values), ("adjacent", out, first),
                  ("compact", compact, first))
        for name, dst, index in stores:
            for bm, bk, warps, stages in RIGHT_TILINGS:
                t = ms(lambda: launch(dst, a, b, index, 1, bm, OE_K, bk, warps, stages))
                res["right"].append([k, name, bm, bk, warps, stages, round(t * 1e3, 1), round(2 * m * k / t / 1e6)])
                print(res["right"][-1], flush=True)
        with ops.reference_only():
            t = ms(lambda: ops.outlier_matmul(out, a, b, idx, 1))
        res["right"].append([k, "torch", 0, 0, 0, 0, round(t * 1e3, 1), round(2 * m * k / t / 1e6)])


def oe_left(res: dict) -> None:
    for n, k in ((4096, 4096), (4096, 14336), (14336, 4096)):
        a = torch.randn(OE_K, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        idx = torch.randperm(TOKENS, device="cuda")[:OE_K]
        for bn, bk, warps, stages in LEFT_TILINGS:
            t = ms(lambda: launch(out, a, b, idx, 0, OE_K, bn, bk, warps, stages))
            res["left"].append([n, k, bn, bk, warps, stages, round(t * 1e3, 1), round(2 * n * k / t / 1e6)])
            print(res["left"][-1], flush=True)


def split(res: dict) -> None:
    for m, n, k in ((TOKENS, 4096, 4096), (TOKENS, 14336, 4096), (TOKENS, 4096, 14336), (TOKENS, 6144, 4096)):
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        plain_l, plain_r = (prepare_operand(t, Strategy.MXFP4, side, QuantSpec()) for t, side in ((x, "L"), (w, "R")))
        for strategy in (Strategy.OE_LEFT, Strategy.OE_RIGHT):
            left, right = (prepare_operand(t, strategy, side, QuantSpec()) for t, side in ((x, "L"), (w, "R")))
            times = {"main": [], "split": [], "plain": []}
            for _ in range(3):
                times["main"].append(ms(lambda: ops.mx_matmul(left.quantized, right.quantized, torch.bfloat16)))
                times["split"].append(ms(lambda: tn_matmul(left, right, torch.bfloat16)))
                times["plain"].append(ms(lambda: tn_matmul(plain_l, plain_r, torch.bfloat16)))
            medians = [round(statistics.median(v) * 1e3, 1) for v in times.values()]
            rounds = [[round(t * 1e3) for t in v] for v in times.values()]
            res["split"].append([m, n, k, strategy.value, *medians, *rounds])
            print(res["split"][-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    res = {"right": [], "left": [], "split": []}
    oe_right(res)
    oe_left(res)
    split(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=0)


if __name__ == "__main__":
    main()
