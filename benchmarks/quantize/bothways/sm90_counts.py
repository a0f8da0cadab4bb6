"""sm_90 compile check of the one-read, both-orientations kernel (``kernel.py``), without a GPU: registers,
spills (stack bytes) and static SASS instructions per element, against what it replaces: ``quantize_fold_fp8``'s
kernel plus ``quantize_mx_triton(axis=0)``'s column kernel at the same shape and options.

Compiled with Triton's bundled ``ptxas``, pointers and integer arguments specialized as multiples of 16, as the
JIT does at training shapes, at 128- and 256-wide chunks (4 and 8 warps), reading the source twice or
``staged`` (the second pass from the packed rows). The prototype loops over a row strip twice, so its static count is one chunk of
each pass (plus the prologue, counted as if per chunk: a slight overestimate) over the chunk's 32 x ``BLOCK_N``
elements; both sides of the fold's branch are counted, as ``sass_counts.py`` does. Use the GPU machine's
Triton (3.6.0 on the H200) or CI's:

    env -u TRITON_INTERPRET PYTHONPATH=src python3 benchmarks/quantize/bothways/sm90_counts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/quantize: sass_counts, epilogue, bothways

import torch  # noqa: E402
import triton  # noqa: E402

from adahop.kernels import quantize as q  # noqa: E402
from adahop.kernels import quantize_fold as qf  # noqa: E402
from adahop.kernels.launch import quantize_spec  # noqa: E402
from bothways.kernel import CUDA_BLOCK_N, _fold_rows_and_cols_kernel  # noqa: E402
from epilogue.sm90_counts import FOLD_TYPES, compile_for_sm90  # noqa: E402
from ptx_fingerprint import LAUNCH_OPTIONS, POINTERS, compile_kernel  # noqa: E402
from sass_counts import per_element, resource_usage  # noqa: E402

TOKENS = 16384
BOTHWAYS_TYPES = {
    "x_ptr": "*i16", "signs_ptr": "*fp32", "out_ptr": "*u8", "row_scale_ptr": "*i32", "lossy_ptr": "*i32",
    "row_score_ptr": "*fp32", "col_data_ptr": "*i32", "col_scale_ptr": "*u8", "col_score_ptr": "*i32",
    "M": "i32", "N": "i32", "m_padded": "i32", "row_seed_ptr": "*i64", "col_seed_ptr": "*i64",
    "row_hadamard_scale": "fp32", "col_hadamard_scale": "fp32", "packed_ptr": "*i32", "packed_scale_ptr": "*u8",
}  # fmt: skip
# (label, row length, rounding, row scores, column scores): X as the forward (IHT) and wgrad (IHT, or OE-right,
# which scores Xᵀ's rows) take it; dY as dgrad (IHT, or OE-left: scores) and wgrad take it.
CASES = (
    ("X, wgrad IHT", 2048, "nearest", False, False),
    ("X, wgrad OE-right", 2048, "nearest", False, True),
    ("dY", 8192, "stochastic", False, False),
    ("dY, dgrad OE-left", 2048, "stochastic", True, False),
)


def spec(rounding: str, scores: bool):
    return quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, 32, False, scores)


def bothways(n: int, rounding: str, row_scores: bool, col_scores: bool, block_n: int, staged: bool):
    constexprs = dict(STRIDE_M=n, BLOCK_N=block_n, MASKED=False, STAGED=staged, ROW_SPEC=spec(rounding, row_scores),
                      COL_SPEC=spec(rounding, col_scores))  # fmt: skip
    unused = {
        "row_score_ptr": row_scores,
        "col_score_ptr": col_scores,
        "packed_ptr": staged,
        "packed_scale_ptr": staged,
    }
    constexprs |= {name: None for name, on in unused.items() if not on}
    options = {"num_warps": block_n // 32}
    return compile_for_sm90(_fold_rows_and_cols_kernel, BOTHWAYS_TYPES, constexprs, options), 32 * block_n


def fold_rows(n: int, rounding: str, scores: bool):
    block_m, block_n, warps = qf._tile(n, True)
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec(rounding, scores))
    if not scores:
        constexprs["score_ptr"] = None
    types = {**FOLD_TYPES, "x_ptr": "*i16", "score_ptr": "*fp32"}
    options = {"num_warps": warps, "maxnreg": qf.MAX_REGISTERS}
    return compile_for_sm90(qf._quantize_fold_rows_kernel, types, constexprs, options), block_m * block_n


def cols(n: int, rounding: str, scores: bool):
    plan = q._launch_plan(TOKENS, n, (n, 1), spec(rounding, scores), False, True, None, None)
    constexprs = {k: v for k, v in plan.constexprs.items() if k not in LAUNCH_OPTIONS}
    if not scores:
        constexprs["score_ptr"] = None
    options = {k: plan.constexprs[k] for k in LAUNCH_OPTIONS if plan.constexprs.get(k) is not None}
    compiled = compile_kernel(plan.kernel, constexprs, options, POINTERS, aligned=True)
    return compiled, 32 * constexprs["BLOCK_N"]


def describe(name: str, compiled, elements: int) -> tuple[str, float]:
    usage = resource_usage(compiled)
    per_elem, _ = per_element(compiled, elements)
    warps = compiled.metadata.num_warps
    line = (f"  {name:<44} w{warps:<2} | reg {usage['REG']:3d} stack {usage['STACK']:3d} "
            f"smem {compiled.metadata.shared:5d} | {per_elem:6.2f} instr/elem")  # fmt: skip
    return line, per_elem


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, bf16 in, H32 both orientations; per program: warps; per thread:")
    print("registers, stack bytes (spills); shared memory bytes; static SASS instructions per element")
    for label, n, rounding, row_scores, col_scores in CASES:
        print(f"{label}: {TOKENS}x{n}, {rounding}")
        split = 0.0
        for name, (compiled, elements) in (
            ("split: quantize_fold_fp8 rows", fold_rows(n, rounding, row_scores)),
            ("split: quantize_mx_triton(axis=0) cols", cols(n, rounding, col_scores)),
        ):
            line, per_elem = describe(name, compiled, elements)
            split += per_elem
            print(line, flush=True)
        print(f"  {'split total':<44} {split:52.2f} instr/elem")
        for staged in (False, True):
            for block_n in (CUDA_BLOCK_N, 2 * CUDA_BLOCK_N):
                compiled, elements = bothways(n, rounding, row_scores, col_scores, block_n, staged)
                name = f"one read, both ways{', staged' * staged}, BLOCK_N {block_n}"
                print(describe(name, compiled, elements)[0], flush=True)


if __name__ == "__main__":
    main()
