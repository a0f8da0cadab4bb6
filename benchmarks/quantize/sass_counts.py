"""Static sm_90 instruction counts per element of the quantize kernels, without a GPU.

The quantizer is bound by the instructions it issues (the integer-logic pipe most of all), so
the count per element predicts its speed before a GPU run. Triton compiles each kernel for
``sm_90`` with the ``ptxas`` it bundles; this script disassembles the cubin and divides the
instructions of one program (no loops in these kernels) by the elements a thread handles.
Specializations mirror what the JIT does at run time (unit inner stride, 16-divisible sizes).
Counts depend on the Triton version: use the GPU machine's (3.6.0 on the H200 here), e.g.

    python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    PYTHONPATH=src /tmp/t36/bin/python benchmarks/quantize/sass_counts.py
"""

from __future__ import annotations

import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adahop.formats.mx import ELEMENT_FORMATS
from adahop.kernels.launch import max_code
from adahop.kernels.quantize_general import _quantize_mx_kernel
from adahop.kernels.quantize_mxfp4 import _quantize_cols_kernel, _quantize_rows_kernel
from adahop.kernels.quantize_tiling import CUDA_TILINGS

MXFP4 = ELEMENT_FORMATS["mxfp4"]
FORMAT = dict(
    RULE="floor",
    EMAX=MXFP4.emax,
    EMIN=MXFP4.emin,
    MBITS=MXFP4.mbits,
    MAX_NORMAL=MXFP4.max_normal,
    MAX_CODE=max_code(MXFP4),
)
BF16_IN = dict(INPUT_BF16=True, ROUND_TO="bf16", NATIVE_CASTS=True, HAS_SIGNS=False, SCORES=False)
_INSTRUCTION = re.compile(r"^[0-9a-f-]{2}:\S+\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def compile_sm90(kernel, args: dict[str, str], constants: dict, num_warps: int):
    """Compile ``kernel`` for sm_90; ``args`` maps runtime arguments to Triton types."""
    names = kernel.arg_names  # the signature follows the kernel's argument order
    constants = {"score_ptr": None, **constants}  # no outlier scores: the pointer is never read
    signature = {n: "constexpr" if n in constants else args[n] for n in names}
    divisible = [n for n, t in args.items() if t.startswith("*") or n in ("M", "N", "stride_m", "m_padded", "n_padded")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def per_element(compiled, elements_per_program: int) -> tuple[float, Counter]:
    ops = Counter()
    for line in compiled.asm["sass"].splitlines():
        if m := _INSTRUCTION.match(line):
            ops[m.group(1).split(".")[0]] += 1
    ops.pop("NOP", None)
    threads = 32 * compiled.metadata.num_warps
    return sum(ops.values()) * threads / elements_per_program, ops


def cases():
    """(name, compiled kernel, elements per program) for the kernels ``quantize_mx_triton`` picks."""
    general = {
        "x_ptr": "*i16",
        "signs_ptr": "*fp32",
        "row_data_ptr": "*i32",
        "row_scale_ptr": "*u8",
        "col_data_ptr": "*i32",
        "col_scale_ptr": "*u8",
        "M": "i32",
        "N": "i32",
        "stride_m": "i32",
        "m_padded": "i32",
        "n_padded": "i32",
        "seed_ptr": "*i64",
        "hadamard_scale": "fp32",
    }
    for orientation in ("both",):
        for stochastic in (False, True):
            t = CUDA_TILINGS[orientation, False].fit(32, 32)  # whole blocks both ways, as the launch does
            consts = dict(
                stride_n=1,
                ROWWISE=True,
                COLWISE=orientation == "both",
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
                HADAMARD=0,
                HADAMARD_STAGES=0,
                BLOCK_SIZE=32,
                STOCHASTIC=stochastic,
                ELEMENT_BITS=4,
                CODES_PER_UNIT=8,
                **BF16_IN,
                **FORMAT,
            )
            yield (
                f"{orientation} {'SR' if stochastic else 'RN'} (general kernel)",
                compile_sm90(_quantize_mx_kernel, general, consts, t.num_warps),
                t.block_m * t.block_n,
            )
    rows = {
        "x_ptr": "*i16",
        "signs_ptr": "*fp32",
        "data_ptr": "*i32",
        "scale_ptr": "*u8",
        "M": "i32",
        "N": "i32",
        "stride_m": "i32",
        "n_padded": "i32",
        "seed_ptr": "*i64",
        "hadamard_scale": "fp32",
    }
    cols = {**rows, "m_padded": "i32"}
    del cols["n_padded"]
    for stochastic in (False, True):
        tag = "SR" if stochastic else "RN"
        for hb in (0, 32):
            t = CUDA_TILINGS["rowwise", bool(hb)]
            consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, HADAMARD=hb, STOCHASTIC=stochastic, **BF16_IN, **FORMAT)
            yield (
                f"rowwise{' H32' if hb else ''} {tag}",
                compile_sm90(_quantize_rows_kernel, rows, consts, t.num_warps),
                t.block_m * t.block_n,
            )
        for hb in (0, 32):
            t = CUDA_TILINGS["colwise", bool(hb)]
            consts = dict(BLOCK_N=t.block_n, HADAMARD=hb, STOCHASTIC=stochastic, **BF16_IN, **FORMAT)
            yield (
                f"colwise{' H32' if hb else ''} {tag}",
                compile_sm90(_quantize_cols_kernel, cols, consts, t.num_warps),
                32 * t.block_n,
            )


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, bf16 in, MXFP4 out: instructions per element")
    for name, compiled, elements in cases():
        total, ops = per_element(compiled, elements)
        top = ", ".join(f"{op} {n * 32 * compiled.metadata.num_warps / elements:.1f}" for op, n in ops.most_common(6))
        print(f"{name:<32} {total:5.1f}   {top}")


if __name__ == "__main__":
    main()
