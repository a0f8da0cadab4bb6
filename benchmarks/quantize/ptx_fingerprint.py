"""sm_90 PTX fingerprints of every quantize kernel variant the launch plans pick, without a GPU.

Triton compiles for ``GPUTarget("cuda", 90, 32)`` on a CPU-only machine (the ``ptxas`` it bundles
included), so a change to kernel code can be checked against the GPU before a GPU is at hand: a
refactor that leaves every fingerprint unchanged leaves the code the H200 runs unchanged
(debug sections, ``.loc`` lines and label names are left out: they name source lines, not code).

    env -u TRITON_INTERPRET PYTHONPATH=src python benchmarks/quantize/ptx_fingerprint.py > after.txt

Run it before and after a change with the same Triton (CI's is 3.9, the H200's 3.6) and diff.
``tests/test_kernels_compile.py`` runs it, so every variant must compile for sm_90 in CI too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adahop.kernels import fold
from adahop.kernels import quantize as q
from adahop.kernels import quantize_fold as qf
from adahop.kernels.launch import quantize_spec
from adahop.kernels.quantize_general import _quantize_mx_kernel

SM90 = GPUTarget("cuda", 90, 32)
# Triton types of the runtime arguments, by name (bfloat16 input is passed as int16 bits).
POINTERS = {
    "x_ptr": "*i16",
    "signs_ptr": "*fp32",
    "seed_ptr": "*i64",
    "row_scale_ptr": "*u8",
    "col_scale_ptr": "*u8",
    "scale_ptr": "*u8",
    "row_data_ptr": "*i32",
    "col_data_ptr": "*i32",
    "data_ptr": "*i32",
    "out_ptr": "*u8",
    "lossy_ptr": "*i32",
    "score_ptr": "*i32",  # raised by atomic max on the float32 bits
}
FLOAT32_POINTERS = {**POINTERS, "x_ptr": "*fp32"}
FOLD_POINTERS = {**POINTERS, "row_scale_ptr": "*i32", "score_ptr": "*fp32"}  # row scales written as bits
# The fold of packed MXFP4: codes and scales in, a byte-pair table, E4M3 pairs out (as int16).
PACKED_FOLD_POINTERS = {
    "data_ptr": "*u8",
    "scales_ptr": "*u8",
    "lut_ptr": "*i32",
    "out_ptr": "*i16",
    "row_scale_ptr": "*i32",
    "lossy_ptr": "*i32",
}


LAUNCH_OPTIONS = ("num_warps", "maxnreg")  # compile options, not kernel arguments


def compile_kernel(
    kernel: triton.JITFunction, constexprs: dict, options: dict, pointers: dict, aligned: bool = False
) -> triton.compiler.CompiledKernel:
    """``kernel`` compiled for sm_90 with ``constexprs``; ``aligned``: its pointers and integer
    arguments specialized as multiples of 16, as the JIT does at training shapes."""
    names = kernel.arg_names
    signature = {
        n: "constexpr"
        if n in constexprs
        else pointers[n]
        if n.endswith("_ptr")
        else "fp32"
        if n == "hadamard_scale"
        else "i32"
        for n in names
    }
    divisible = [n for n, t in signature.items() if t.startswith(("*", "i32"))] if aligned else []
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    return triton.compile(source, target=SM90, options=options)


def compile_sm90(kernel: triton.JITFunction, constexprs: dict, options: dict, pointers: dict) -> str:
    """The kernel's PTX for sm_90 with ``constexprs``, debug information left out."""
    ptx = compile_kernel(kernel, constexprs, options, pointers).asm["ptx"]
    code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    lines = (line for line in code.splitlines() if not line.strip().startswith((".loc", ".file", "//")))
    return re.sub(r"\$L__\w+", "L", "\n".join(lines))


def _scored(constexprs: dict) -> dict:
    """A launch without scores passes no score pointer (a constexpr None, as at run time)."""
    return constexprs if constexprs["SPEC"].scores else {**constexprs, "score_ptr": None}


def variants() -> Iterator[tuple[str, triton.JITFunction, dict, dict, dict]]:
    """(name, kernel, compile-time arguments, compile options, pointer types) of bf16 MXFP4 launches, and
    of float32 ones that record scores; those that record outlier scores are named so (one orientation only)."""
    shape = (256, 512)
    orientations = (
        (True, False, False),
        (False, True, False),
        (True, True, False),
        (True, False, True),
        (False, True, True),
    )
    for rowwise, colwise, scores in orientations:
        for rounding in ("nearest", "stochastic"):
            for hb in (0, 32):
                spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, hb, False, scores)
                plan = q._launch_plan(*shape, (shape[1], 1), spec, rowwise, colwise, None, None)
                constexprs = _scored({k: v for k, v in plan.constexprs.items() if k not in LAUNCH_OPTIONS})
                options = {k: plan.constexprs[k] for k in LAUNCH_OPTIONS if plan.constexprs.get(k) is not None}
                if plan.kernel is _quantize_mx_kernel:
                    constexprs["stride_n"] = 1  # the JIT specializes a unit stride
                orientation = "both" if rowwise and colwise else "rowwise" if rowwise else "colwise"
                yield (
                    f"{plan.kernel.__name__} {orientation} {rounding} hadamard {hb}{' scores' * scores}",
                    plan.kernel,
                    constexprs,
                    options,
                    POINTERS,
                )
    for scores in (False, True):
        for rounding in ("nearest", "stochastic"):
            for hb in (0, 32):
                block_m, block_n, warps = qf._tile(2048, True)
                spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, hb, False, scores)
                constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec)
                yield (
                    f"_quantize_fold_rows_kernel {rounding} hadamard {hb}{' scores' * scores}",
                    qf._quantize_fold_rows_kernel,
                    _scored(constexprs),
                    {"num_warps": warps, "maxnreg": qf.MAX_REGISTERS},
                    FOLD_POINTERS,
                )
    # float32 input (loaded as floats, not bf16 bits) where the loaded values are also scored: the
    # row-wise and fused fold kernels, whose scores convert the loads a second time
    spec_args = ("mxfp4", 32, "floor")
    for rounding in ("nearest", "stochastic"):
        spec = quantize_spec(torch.float32, True, *spec_args, rounding, 32, False, True)
        plan = q._launch_plan(256, 512, (512, 1), spec, True, False, None, None)
        constexprs = {k: v for k, v in plan.constexprs.items() if k not in LAUNCH_OPTIONS}
        options = {k: plan.constexprs[k] for k in LAUNCH_OPTIONS if plan.constexprs.get(k) is not None}
        yield (f"{plan.kernel.__name__} rowwise {rounding} hadamard 32 scores float32", plan.kernel, constexprs,
               options, FLOAT32_POINTERS)  # fmt: skip
        block_m, block_n, warps = qf._tile(2048, True)
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec)
        yield (f"_quantize_fold_rows_kernel {rounding} hadamard 32 scores float32", qf._quantize_fold_rows_kernel,
               constexprs, {"num_warps": warps, "maxnreg": qf.MAX_REGISTERS}, {**FOLD_POINTERS, "x_ptr": "*fp32"})  # fmt: skip
    config = fold.FoldConfig()
    for split in (False, True):
        constexprs = dict(
            HALF_BLOCK=16, BLOCK_R=config.block_r, CHUNK=config.chunk, SCALE_CHUNK=config.scale_chunk, SPLIT=split
        )
        options = {"num_warps": config.num_warps, "maxnreg": config.max_registers}
        yield f"_fold_kernel{' split' * split}", fold._fold_kernel, constexprs, options, PACKED_FOLD_POINTERS


def main() -> None:
    for name, kernel, constexprs, options, pointers in variants():
        ptx = compile_sm90(kernel, constexprs, options, pointers)
        print(f"{name}: {hashlib.sha256(ptx.encode()).hexdigest()[:16]} ({len(ptx)} chars)")


if __name__ == "__main__":
    main()
