"""Host (CPU) time per call of the quantize, fold and GEMM launches and of a whole AdaHOPLinear
forward+backward, at shapes so small that the GPU waits for the CPU; plus a cProfile of the layer.

A training step of a 1B model makes about 1,500 of these launches, so microseconds of Python per
launch decide whether the step is host-bound. Run on a CUDA machine:

    PYTHONPATH=src python benchmarks/host_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from torch import nn

from adahop import ops
from adahop.formats import QuantSpec
from adahop.kernels.fold import fold_to_fp8
from adahop.kernels.quantize import quantize_mx_triton
from adahop.nn import AdaHOPLinear
from adahop.policy.strategies import LayerPlan, Strategy

SIZE = 256  # tokens, in and out features: launch-bound on any GPU
CALLS = 200


def host_us(fn, calls: int = CALLS) -> float:
    """Microseconds of wall time per call once the GPU is idle (the CPU is the bottleneck)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def launch_paths(x: torch.Tensor) -> dict[str, float]:
    """The row-wise kernel launched through ``JITFunction`` (binding, specialization and cache
    lookup in Python every call) against its ``CompiledKernel`` launched directly."""
    from adahop.kernels import quantize as qk

    plan = qk._launch_plan(
        *x.shape, x.dtype, x.stride(), True, "mxfp4", True, False, 32, "floor", "nearest", 0, None, False, None
    )
    data = torch.empty(plan.row_shapes[0], dtype=torch.uint8, device=x.device).view(torch.int32)
    scales = torch.empty(plan.row_shapes[1], dtype=torch.uint8, device=x.device)
    args = [x.view(torch.int16), x, data, scales, *plan.sizes, 5, plan.hadamard_scale]
    launch = plan.kernel[plan.grid]
    compiled = launch(*args, **plan.constexprs)
    figures = {"Triton JIT launch (rows kernel)": host_us(lambda: launch(*args, **plan.constexprs))}
    try:
        ordered = args + [plan.constexprs[name] for name in plan.kernel.arg_names[len(args) :]]
        runner = compiled[plan.grid]
        figures["CompiledKernel launch (rows kernel)"] = host_us(lambda: runner(*ordered))
    except Exception as err:  # an internal API: report, do not fail the run
        print(f"CompiledKernel launch failed: {err!r}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args()
    x = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor(7)
    q = quantize_mx_triton(x)
    plan = LayerPlan(Strategy.IHT, Strategy.IHT, Strategy.OE_RIGHT)
    layer = AdaHOPLinear(SIZE, SIZE, bias=False, recipe="adahop_lv2").cuda()
    layer.set_plan(plan)
    linear = nn.Linear(SIZE, SIZE, bias=False).cuda()
    xin = torch.randn(SIZE, SIZE, device="cuda", requires_grad=True)

    def fwd_bwd(module):
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(xin)
            y.float().sum().backward()

        return step

    figures = {
        "torch.matmul bf16": host_us(lambda: x @ x),
        "quantize_mx_triton rowwise RN": host_us(lambda: quantize_mx_triton(x)),
        "quantize_mx_triton rowwise H32 RN": host_us(lambda: quantize_mx_triton(x, hadamard_block_size=32)),
        "quantize_mx_triton colwise SR": host_us(lambda: quantize_mx_triton(x, axis=0, rounding="stochastic", seed=3)),
        "ops.quantize_2d rowwise H32": host_us(lambda: ops.quantize_2d(x, QuantSpec(), axis=1, seed=seed)),
        "fold_to_fp8": host_us(lambda: fold_to_fp8(q)),
        "ops.mx_matmul": host_us(lambda: ops.mx_matmul(q, q, torch.bfloat16)),
        "nn.Linear fwd+bwd": host_us(fwd_bwd(linear)),
        "AdaHOPLinear (iht, iht, oe_right) fwd+bwd": host_us(fwd_bwd(layer)),
    }
    figures.update(launch_paths(x))
    for name, us in figures.items():
        print(f"{name:<45} {us:8.1f} us")

    profiler = cProfile.Profile()
    profiler.enable()
    step = fwd_bwd(layer)
    for _ in range(CALLS):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(f"cProfile of {CALLS} AdaHOPLinear forward+backward calls, by own time:")
    print(text.getvalue())
    if args.out:
        report = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "size": SIZE,
            "host_us_per_call": figures,
            "cprofile": text.getvalue(),
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
