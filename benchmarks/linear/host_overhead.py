"""Host (CPU) time per call of the quantize, fold and GEMM launches and of a whole AdaHOPLinear
forward+backward, at shapes so small that the GPU waits for the CPU; plus a cProfile of the layer.

A training step of a 1B model makes about 1,500 of these launches, so microseconds of Python per
launch decide whether the step is host-bound. Run on a CUDA machine:

    PYTHONPATH=src python benchmarks/linear/host_overhead.py [--out results.json]

``--dry-run`` checks on the CPU, in Triton's interpreter, the launches it makes itself (the rest
go through the library): each quantize kernel's arguments, as the library prepares them, name
exactly its parameters, and launched positionally in signature order (as a ``CompiledKernel``
takes them) they write what the keyword launch writes:

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/linear/host_overhead.py --dry-run
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import time

import torch
from torch import nn
from triton.backends.nvidia.compiler import CUDAOptions

from adahop import ops
from adahop.formats import QuantSpec
from adahop.kernels.fold import fold_to_fp8
from adahop.kernels.launch import INTERPRET
from adahop.kernels.quantize import QuantizeLaunch, quantize_launch, quantize_mx_triton
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


# The quantize kernels' launches, one per kernel the plans pick: row-wise with a 32-point Hadamard
# (the forward's operands), column-wise stochastic (wgrad's) and both orientations from one read.
LAUNCHES = {
    "rows H32 RN": dict(rowwise=True, colwise=False, rounding="nearest", hadamard_block_size=32),
    "cols SR": dict(rowwise=False, colwise=True, rounding="stochastic", hadamard_block_size=0),
    "both RN": dict(rowwise=True, colwise=True, rounding="nearest", hadamard_block_size=0),
}
LAUNCH_OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}  # num_warps, ...: not kernel parameters


def prepare(x: torch.Tensor, options: dict) -> QuantizeLaunch:
    return quantize_launch(
        x, "mxfp4", block_size=32, scale_rule="floor", seed=3, signs=None, scores=False, tiling=None, **options
    )


def in_signature_order(launch: QuantizeLaunch) -> list:
    """The launch's arguments as a ``CompiledKernel`` takes them: every parameter, in order."""
    names = launch.kernel.arg_names
    missing = [n for n in names if n not in launch.arguments]
    unknown = [n for n in launch.arguments if n not in names and n not in LAUNCH_OPTIONS]
    if missing or unknown:
        raise ValueError(f"{launch.kernel.__name__}: arguments missing {missing}, unknown {unknown}")
    return [launch.arguments[n] for n in names]


def launch_paths(x: torch.Tensor) -> dict[str, float]:
    """Each quantize kernel launched through ``JITFunction`` (binding, specialization and cache
    lookup in Python every call) against its ``CompiledKernel`` launched directly."""
    figures = {}
    for name, options in LAUNCHES.items():
        launch = prepare(x, options)
        ordered = in_signature_order(launch)
        jit = launch.kernel[launch.grid]
        compiled = jit(**launch.arguments)
        figures[f"Triton JIT launch ({name})"] = host_us(lambda: jit(**launch.arguments))
        try:
            runner = compiled[launch.grid]
            figures[f"CompiledKernel launch ({name})"] = host_us(lambda: runner(*ordered))
        except Exception as err:  # an internal API: report, do not fail the run
            print(f"CompiledKernel launch ({name}) failed: {err!r}")
    return figures


def dry_run() -> None:
    """``--dry-run`` (module docstring): on small CPU tensors."""
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    for name, options in LAUNCHES.items():
        launch = prepare(x, options)
        ordered = in_signature_order(launch)
        outputs = [t for q in (launch.row, launch.col) if q is not None for t in (q.data, q.scales)]
        written = []
        for run in (
            lambda: launch.kernel[launch.grid](**launch.arguments),
            lambda: launch.kernel[launch.grid](*ordered),
        ):
            for t in outputs:
                t.zero_()
            run()
            written.append([t.clone() for t in outputs])
        if not all(torch.equal(a, b) for a, b in zip(*written)):
            raise AssertionError(f"{name}: the positional launch of {launch.kernel.__name__} wrote other values")
        print(f"{name}: {launch.kernel.__name__}, {len(ordered)} arguments in signature order: launches alike")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the figures as JSON")
    parser.add_argument("--dry-run", action="store_true", help="check the launches on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.dry_run:
        if not INTERPRET:
            parser.error("--dry-run launches the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        dry_run()
        return
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
